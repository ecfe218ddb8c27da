#include "trainer/loop/lr_schedule.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace mtrain {

LrScheduleKind parse_lr_schedule(const std::string& name) {
  if (name == "constant") return LrScheduleKind::Constant;
  if (name == "step") return LrScheduleKind::Step;
  if (name == "cosine") return LrScheduleKind::Cosine;
  throw InvalidArgument(fmt::format("--lr-schedule: unknown value '{}' (valid: constant, step, cosine)", name));
}

LrSchedule::LrSchedule(LrScheduleOptions options) : options_(options) {
  if (!(options_.total_epochs > 0)) {
    throw InvalidArgument(fmt::format("learning-rate schedule: expected a run longer than 0 epochs, found {}",
                                      options_.total_epochs));
  }
  if (options_.warmup_epochs < 0) {
    throw InvalidArgument(fmt::format("--warmup-epochs: expected a number >= 0, found {}", options_.warmup_epochs));
  }
  if (options_.kind == LrScheduleKind::Step && options_.warmup_epochs >= 0.5 * options_.total_epochs) {
    spdlog::warn("--lr-schedule step: the first drop, at half of the {:g}-epoch run, comes before the {:g}-epoch "
                 "warm-up ends, so the rate falls straight from the ramp and never trains at {:g}; use fewer "
                 "--warmup-epochs or a longer run",
                 options_.total_epochs, options_.warmup_epochs, target_lr());
  }
}

// Note [Learning-rate scaling and warm-up]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// --lr-scaling linear multiplies --lr by the world size: N ranks with per-rank batch B train on
// batches of N*B, and the "N x batch, N x lr" rule (Goyal et al., "Accurate, Large Minibatch SGD",
// 2017) keeps the per-sample step comparable. With --global-batch-size the batch does not grow with
// the world, so nothing is scaled there. A large scaled rate diverges early, so --warmup-epochs
// ramps the rate linearly from --lr (the unscaled rate, as Goyal et al.) to the target over that
// many epochs (fractional epochs, so the ramp is smooth per step). After warm-up: constant; step =
// x0.1 at 50% and 75% of the whole run, warm-up included (the ImageNet ResNet recipe's 30/60/80
// shape, shortened; its milestones stay at fixed epochs when it warms up); cosine = 0.5 * (1 +
// cos(pi * progress)) over the post-warm-up part of the run, reaching 0 at its end (the rate of a
// step is set from the progress before it, so the last step still runs at a small rate, as
// PyTorch's).
double LrSchedule::at(double epoch) const {
  const double target = target_lr();
  const double warmup = options_.warmup_epochs;
  if (warmup > 0 && epoch < warmup) {
    const double start = options_.base_lr;  // the unscaled rate, see the Note
    return start + (target - start) * (epoch / warmup);
  }
  const double span = std::max(options_.total_epochs - warmup, 1e-12);
  const double progress = std::clamp((epoch - warmup) / span, 0.0, 1.0);
  switch (options_.kind) {
    case LrScheduleKind::Constant:
      return target;
    case LrScheduleKind::Step: {
      // Milestones at fixed points of the whole run, warm-up included (Goyal et al. keep
      // theirs at fixed epochs). The position comes in as a fractional epoch computed in
      // double, so a step that lands exactly on a milestone may read a hair below it
      // (362 of 724 steps: 0.49999999999999994); kMilestoneSlack counts it as reached.
      constexpr double kMilestoneSlack = 1e-9;
      const double run = epoch / options_.total_epochs + kMilestoneSlack;
      return target * (run >= 0.75 ? 0.01 : run >= 0.5 ? 0.1 : 1.0);
    }
    case LrScheduleKind::Cosine:
      return target * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
  throw InternalError("unhandled learning-rate schedule");
}

std::string LrSchedule::describe() const {
  const char* kind = options_.kind == LrScheduleKind::Constant ? "constant"
                     : options_.kind == LrScheduleKind::Step   ? "step (x0.1 at 50% and 75%)"
                                                                : "cosine";
  std::string s = fmt::format("lr {} ", target_lr());
  if (options_.world_scale != 1.0) {
    s += fmt::format("(= {} x {} ranks, linear scaling) ", options_.base_lr, options_.world_scale);
  }
  s += kind;
  if (options_.warmup_epochs > 0) {
    s += fmt::format(", linear warm-up from {} over {} epochs", options_.base_lr, options_.warmup_epochs);
  }
  return s;
}

}  // namespace mtrain
