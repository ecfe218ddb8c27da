// Learning-rate schedules: a base rate, optionally scaled with the world size, a linear
// warm-up, then constant, step or cosine decay.
//
// Note [Learning-rate scaling and warm-up]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// --lr-scaling linear multiplies --lr by the world size: N ranks with per-rank batch B
// train on batches of N*B, and the "N x batch, N x lr" rule (Goyal et al., "Accurate,
// Large Minibatch SGD", 2017) keeps the per-sample step comparable. With
// --global-batch-size the batch does not grow with the world, so nothing is scaled
// there. A large scaled rate diverges early, so --warmup-epochs ramps the rate
// linearly from --lr (the unscaled rate, as Goyal et al.) to the target over
// that many epochs (measured in fractional epochs, so the ramp is smooth per step).
// After warm-up: constant; step = x0.1 at 50% and 75% of the whole run, warm-up
// included (the ImageNet ResNet recipe's 30/60/80 shape, shortened; its milestones
// stay at fixed epochs when it warms up); cosine = 0.5 * (1 + cos(pi * progress)) over the
// post-warm-up part of the run, reaching 0 at its end (the rate of a step is set from
// the progress before it, so the last step still runs at a small rate, as PyTorch's).
#pragma once

#include <string>

namespace mtrain {

enum class LrScheduleKind { Constant, Step, Cosine };
LrScheduleKind parse_lr_schedule(const std::string& name);  // InvalidArgument listing the names

struct LrScheduleOptions {
  double base_lr = 0.1;      // --lr
  double world_scale = 1.0;  // multiplier from --lr-scaling (1 = none)
  double warmup_epochs = 0.0;
  double total_epochs = 1.0;  // length of the run in (fractional) epochs
  LrScheduleKind kind = LrScheduleKind::Constant;
};

class LrSchedule {
 public:
  explicit LrSchedule(LrScheduleOptions options);
  // The rate at `epoch` (fractional, 0 = start of training).
  double at(double epoch) const;
  double target_lr() const { return options_.base_lr * options_.world_scale; }
  std::string describe() const;

 private:
  LrScheduleOptions options_;
};

}  // namespace mtrain
