// Learning-rate schedules (trainer/loop/lr_schedule.h): linear scaling, warm-up, step and
// cosine decay, and the warning for a warm-up that outlasts the first drop.
#include <catch2/catch.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>

#include "core/error.h"
#include "trainer/loop/lr_schedule.h"

using Catch::Matchers::Contains;
using namespace mtrain;

TEST_CASE("learning-rate schedules: linear scaling, warm-up, step and cosine", "[lr]") {
  LrScheduleOptions o;
  o.base_lr = 0.1;
  o.world_scale = 4;
  o.total_epochs = 10;
  o.warmup_epochs = 2;
  const LrSchedule constant(o);
  CHECK(constant.target_lr() == Approx(0.4));
  CHECK(constant.at(0) == Approx(0.1));   // warm-up starts at the unscaled rate
  CHECK(constant.at(1) == Approx(0.25));  // halfway
  CHECK(constant.at(2) == Approx(0.4));
  CHECK(constant.at(9.5) == Approx(0.4));

  o.warmup_epochs = 0;
  o.kind = LrScheduleKind::Step;
  const LrSchedule step_schedule(o);
  CHECK(step_schedule.at(4.9) == Approx(0.4));
  CHECK(step_schedule.at(5) == Approx(0.04));
  CHECK(step_schedule.at(7.5) == Approx(0.004));
  // A milestone that falls on a step is reached there: --max-steps 724 at 300 steps an
  // epoch, step 362 is epoch 1 + 62/300 of a 724/300-epoch run, which divides to
  // 0.4999999999999999 of it.
  LrScheduleOptions cut = o;
  cut.total_epochs = 724.0 / 300.0;
  CHECK(LrSchedule(cut).at(1.0 + 62.0 / 300.0) == Approx(0.04));
  // With warm-up the milestones stay at 50 % and 75 % of the whole run (epochs 5 and
  // 7.5 of 10), not of the part after warm-up.
  o.warmup_epochs = 2;
  const LrSchedule warm_step(o);
  CHECK(warm_step.at(1) == Approx(0.25));
  CHECK(warm_step.at(4.9) == Approx(0.4));
  CHECK(warm_step.at(5) == Approx(0.04));
  CHECK(warm_step.at(7.5) == Approx(0.004));
  o.warmup_epochs = 0;

  o.kind = LrScheduleKind::Cosine;
  const LrSchedule cosine(o);
  CHECK(cosine.at(0) == Approx(0.4));
  CHECK(cosine.at(5) == Approx(0.2));
  CHECK(cosine.at(10) == Approx(0.0).margin(1e-12));

  CHECK_THROWS_WITH(parse_lr_schedule("linear"), Contains("valid: constant, step, cosine"));
  o.total_epochs = 0;
  CHECK_THROWS_AS(LrSchedule(o), InvalidArgument);
}

TEST_CASE("a step schedule whose warm-up outlasts its first drop is warned about", "[lr]") {
  std::ostringstream captured;
  const auto previous = spdlog::default_logger();
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(captured)));
  LrScheduleOptions o;
  o.kind = LrScheduleKind::Step;
  o.total_epochs = 4;
  o.warmup_epochs = 1;  // ends before the drop at epoch 2: fine
  const LrSchedule fine(o);
  o.warmup_epochs = 3;  // the drop at epoch 2 comes first
  const LrSchedule late(o);
  spdlog::set_default_logger(previous);
  const std::string log = captured.str();
  CHECK(std::count(log.begin(), log.end(), '\n') == 1);
  CHECK_THAT(log, Contains("comes before the 3-epoch warm-up ends"));
}
