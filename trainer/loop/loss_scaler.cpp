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

// Note [Dynamic loss scaling]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// float16 gradients below 2^-24 flush to zero. So the loss gradient is multiplied by a scale S
// before backward (every gradient is then S times too large, and the small ones survive the 16-bit
// operands of the kernels, Note [Mixed precision]), and once the step's gradients are final every
// gradient is multiplied by 1/S before the optimizer sees it. If any gradient element is infinite
// or NaN, S was too large: the optimizer step is skipped (parameters and momentum stay as they
// were), S is halved, and the run goes on with the next batch; after `growth_interval` steps in a
// row with finite gradients S is doubled, so it keeps tracking the largest safe value. Defaults are
// GradScaler's. Scaling by a power of two is exact, so with a power-of-two S (any the defaults
// produce) and while nothing overflows or underflows, the step equals the unscaled one bit for bit.
// The scale only multiplies backward: a loss that is not finite is a forward problem no scale
// fixes, and stops the run as diverged (Note [Agreeing to diverge] in train_loop.cpp) instead of
// being skipped, where GradScaler would skip and halve forever.
//
// In a distributed run no collective is needed to agree on skipping: the check runs on the
// all-reduced gradients, and an infinite or NaN element on any rank makes the sum non-finite on
// every rank (the reduced buckets are bitwise the same on every rank, the property that keeps the
// replicas identical and --check-replicas verifies). Every rank therefore holds the same S,
// including after a resume (checkpointer.cpp sends rank 0's state to all). A skipped step still
// counts as a step (the learning-rate schedule, --max-steps and checkpoints see it), as in a
// PyTorch loop with GradScaler. Gradients that are never finite are a diverged run, not an
// overflow: after kMaxConsecutiveSkips skipped steps in a row the run stops with an error.
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
