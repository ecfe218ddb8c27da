// Learning-rate schedules: a base rate, optionally scaled with the world size, a linear warm-up,
// then constant, step or cosine decay (Note [Learning-rate scaling and warm-up] in
// lr_schedule.cpp). A schedule is a pure function of the position in the run, so a resumed run
// gets the rates of the uninterrupted one.
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
  // Throws InvalidArgument for total_epochs <= 0 or warmup_epochs < 0.
  explicit LrSchedule(LrScheduleOptions options);
  // The rate at `epoch` (fractional, 0 = start of training): during warm-up linear from base_lr
  // to target_lr(); then constant, x0.1 at 50 % and 75 % of the run (step), or cosine to 0.
  double at(double epoch) const;
  double target_lr() const { return options_.base_lr * options_.world_scale; }
  std::string describe() const;

 private:
  LrScheduleOptions options_;
};

}  // namespace mtrain
