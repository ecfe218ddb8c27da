// unit: what turns --cuda-graphs off for a run (step_graph_unsupported, trainer/loop/
// step_graph.h), each reason named; no GPU needed. The graphs themselves run in
// test_train_cuda (gpu) and tests/tensor/test_cuda_graph.cpp (gpu).
#include <catch2/catch.hpp>

#include <memory>

#include "models/activation.h"
#include "models/dropout.h"
#include "models/linear.h"
#include "models/sequential.h"
#include "models/sync_batchnorm.h"
#include "tests/support/solo_group.h"
#include "trainer/ddp/gradient_sync.h"
#include "trainer/ddp/reducer.h"
#include "trainer/loop/step_graph.h"

using Catch::Matchers::Contains;
using namespace mtrain;

namespace {

std::unique_ptr<models::Sequential> small_net() {
  auto m = std::make_unique<models::Sequential>();
  m->append(std::make_unique<models::Linear>(8, 8));
  m->append(std::make_unique<models::ReLU>());
  m->append(std::make_unique<models::Linear>(8, 2));
  return m;
}

StepGraphSettings on_gpu() {
  StepGraphSettings s;
  s.device = Device::cuda(0);
  return s;
}

}  // namespace

TEST_CASE("a world of one on a GPU with replayable layers can capture its steps", "[step_graph]") {
  auto model = small_net();
  LocalGradients local;
  local.attach(*model);
  CHECK(step_graph_unsupported(on_gpu(), *model, local).empty());
  // A one-rank group's reducer queues nothing either (Note [A group of one reduces nothing]).
  testing::SoloGroup solo;
  Reducer reducer(solo.group, ReducerOptions{});
  auto other = small_net();
  reducer.attach(*other);
  CHECK(step_graph_unsupported(on_gpu(), *other, reducer).empty());
}

TEST_CASE("each setting that a replay cannot repeat is named", "[step_graph]") {
  auto model = small_net();
  LocalGradients local;
  local.attach(*model);
  CHECK_THAT(step_graph_unsupported(StepGraphSettings{}, *model, local), Contains("on the CPU"));
  StepGraphSettings s = on_gpu();
  s.grad_accum = 4;
  CHECK_THAT(step_graph_unsupported(s, *model, local), Contains("--grad-accum 4"));
  s = on_gpu();
  s.loss_scaling = true;
  CHECK_THAT(step_graph_unsupported(s, *model, local), Contains("--amp fp16"));
  s = on_gpu();
  s.time_compute = true;
  CHECK_THAT(step_graph_unsupported(s, *model, local), Contains("--balance"));

  testing::SoloGroup solo;
  ReducerOptions compressed;
  compressed.compression = DType::BFloat16;
  Reducer reducer(solo.group, compressed);
  auto other = small_net();
  reducer.attach(*other);
  CHECK_THAT(step_graph_unsupported(on_gpu(), *other, reducer),
             Contains("synchronizer queues its own work") && Contains("all-reduced in bfloat16"));
}

TEST_CASE("a layer that decides on the host per call is named with its path", "[step_graph]") {
  auto with_dropout = small_net();
  with_dropout->append("drop", std::make_unique<models::Dropout>(0.5f, 1));
  LocalGradients local;
  local.attach(*with_dropout);
  CHECK_THAT(step_graph_unsupported(on_gpu(), *with_dropout, local), Contains("layer drop (Dropout)"));

  auto without = small_net();
  without->append("drop", std::make_unique<models::Dropout>(0.0f, 1));  // passes its input through
  LocalGradients local2;
  local2.attach(*without);
  CHECK(step_graph_unsupported(on_gpu(), *without, local2).empty());

  testing::SoloGroup solo;
  auto with_sync_bn = std::make_unique<models::Sequential>();
  with_sync_bn->append("bn", std::make_unique<models::SyncBatchNorm>(4, solo.group));
  LocalGradients local3;
  local3.attach(*with_sync_bn);
  CHECK_THAT(step_graph_unsupported(on_gpu(), *with_sync_bn, local3), Contains("layer bn (SyncBatchNorm)"));
}
