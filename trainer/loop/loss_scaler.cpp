#include "trainer/loop/loss_scaler.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <limits>

#include "core/error.h"
#include "tensor/ops.h"

namespace mtrain {

namespace {

// A normal float32 whose reciprocal is one too: the loss gradient is multiplied by the
// scale and the gradients by its reciprocal, both in float32.
bool valid_scale(double s) {
  return s >= std::numeric_limits<float>::min() && s <= std::numeric_limits<float>::max();
}

}  // namespace

LossScaler::LossScaler(const LossScalerOptions& options) : options_(options) {
  state_.scale = options.initial_scale;
  if (!valid_scale(options.initial_scale) || !(options.growth_factor > 1.0) ||
      !(options.backoff_factor > 0.0 && options.backoff_factor < 1.0) || options.growth_interval < 1) {
    throw InvalidArgument(fmt::format(
        "loss scaler: expected an initial scale in [2^-126, float32's largest], growth factor > 1, backoff "
        "factor in (0, 1) and growth interval >= 1, found {}, {}, {}, {}",
        options.initial_scale, options.growth_factor, options.backoff_factor, options.growth_interval));
  }
}

bool LossScaler::unscale_and_update(const std::vector<Tensor*>& grads) {
  const double used = state_.scale;
  const bool found_non_finite = ops::non_finite_check_and_unscale(grads, static_cast<float>(1.0 / used));
  if (found_non_finite) {
    state_.scale = used * options_.backoff_factor;
    state_.good_steps = 0;
    ++state_.skipped_steps;
    ++state_.consecutive_skips;
    if (state_.consecutive_skips >= kMaxConsecutiveSkips || !valid_scale(state_.scale)) {
      throw InvalidArgument(fmt::format(
          "training diverged: the gradients were not finite in {} steps in a row, down to loss scale {}; "
          "lowering the scale did not help, so the model itself produces them (try a smaller --lr)",
          state_.consecutive_skips, used));
    }
    spdlog::info("step skipped: gradients not finite at loss scale {}, which is now {}", used, state_.scale);
    return true;
  }
  state_.consecutive_skips = 0;
  if (++state_.good_steps >= options_.growth_interval) {
    state_.good_steps = 0;
    // Stay where float32 can still hold the scale (GradScaler does the same check).
    if (valid_scale(used * options_.growth_factor)) state_.scale = used * options_.growth_factor;
  }
  return false;
}

void LossScaler::restore(const LossScalerState& state) {
  if (!valid_scale(state.scale) || state.good_steps < 0 || state.skipped_steps < 0 ||
      state.consecutive_skips < 0 || state.consecutive_skips > state.skipped_steps) {
    throw InvalidArgument(fmt::format("loss scaler: cannot restore scale {}, {} good steps, {} skipped ({} in a row)",
                                      state.scale, state.good_steps, state.skipped_steps, state.consecutive_skips));
  }
  state_ = state;
}

}  // namespace mtrain
