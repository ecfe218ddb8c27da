// SyncBatchNorm: in one process on a group of one (must equal BatchNorm2d bitwise),
// convert_sync_batchnorm on resnet18, and across real processes started by
// mtrain-launch with uneven and empty per-rank batches (checked inside
// syncbn_test_worker against a single-process BatchNorm2d on the full batch).
#include <catch2/catch.hpp>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tests/support/solo_group.h"
#include "collectives/process_group.h"
#include "store/store.h"
#include "core/error.h"
#include "models/batchnorm.h"
#include "models/sequential.h"
#include "models/sync_batchnorm.h"
#include "models/zoo.h"
#include "tests/launcher/launch_harness.h"

using namespace mtrain;
using namespace mtrain::models;
using mtrain::testing::LaunchResult;
using mtrain::testing::TempDir;

namespace {

Tensor random_tensor(const Shape& shape, uint32_t seed, float offset) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  Tensor t = Tensor::empty(shape);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = offset + 2.0f * normal(gen);
  return t;
}

void require_bitwise_equal(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  CHECK(a.to_vector<float>() == b.to_vector<float>());
}

using mtrain::testing::SoloGroup;

LaunchResult launch(int nproc, const std::string& sizes, const std::string& hw,
                    const TempDir& dir) {
  return mtrain::testing::run_launcher(
      {"--nproc_per_node=" + std::to_string(nproc), SYNCBN_TEST_WORKER, sizes, hw}, dir.path(), 60);
}

}  // namespace

TEST_CASE("SyncBatchNorm on a group of one equals BatchNorm2d bitwise") {
  SoloGroup solo;
  BatchNorm2d plain(4);
  SyncBatchNorm sync(4, solo.group);
  CHECK(sync.type_name() == "SyncBatchNorm");
  for (int64_t c = 0; c < 4; ++c) {
    plain.weight().value.data<float>()[c] = sync.weight().value.data<float>()[c] = 0.3f * (c + 1);
    plain.bias().value.data<float>()[c] = sync.bias().value.data<float>()[c] = 0.1f * c;
  }
  for (int step = 0; step < 3; ++step) {
    const Tensor x = random_tensor({5, 4, 3, 2}, 10 + step, 1.5f);
    const Tensor dy = random_tensor({5, 4, 3, 2}, 20 + step, 0.0f);
    require_bitwise_equal(sync.forward(x), plain.forward(x));
    require_bitwise_equal(sync.backward(dy), plain.backward(dy));
  }
  require_bitwise_equal(sync.weight().grad, plain.weight().grad);
  require_bitwise_equal(sync.bias().grad, plain.bias().grad);
  require_bitwise_equal(sync.running_mean(), plain.running_mean());
  require_bitwise_equal(sync.running_var(), plain.running_var());
  CHECK(sync.num_batches_tracked() == 3);

  sync.eval();
  plain.eval();
  const Tensor x = random_tensor({2, 4, 3, 3}, 99, -1.0f);
  require_bitwise_equal(sync.forward(x), plain.forward(x));
}

TEST_CASE("SyncBatchNorm rejects a global batch of one value per channel") {
  SoloGroup solo;
  SyncBatchNorm sync(2, solo.group);
  CHECK_THROWS_AS(sync.forward(Tensor::zeros({1, 2, 1, 1})), InvalidArgument);
  CHECK_THROWS_WITH(sync.forward(Tensor::zeros({1, 2, 1, 1})),
                    Catch::Contains("expected more than 1 value per channel when training, got "
                                    "global batch of 1 across 1 ranks"));
  CHECK_THROWS_WITH(SyncBatchNorm(2, nullptr), Catch::Contains("expected a process group"));
}

TEST_CASE("SyncBatchNorm rejects a per-rank count a float32 cannot carry exactly") {
  SoloGroup solo;
  SyncBatchNorm sync(1, solo.group);
  // 4097 * 4096 = 2^24 + 4096 values in the one channel (64 MiB).
  CHECK_THROWS_WITH(sync.forward(Tensor::zeros({1, 1, 4097, 4096})),
                    Catch::Contains("rank 0 has more than 2^24 = 16777216 values per channel"));
}

TEST_CASE("convert_sync_batchnorm swaps every BatchNorm2d of resnet18, keeping names and state") {
  SoloGroup solo;
  auto model = build_model("resnet18", 1, 10);
  // Give every buffer and parameter a distinct value, so a swap that drops state shows.
  float v = 0.0f;
  for (auto& p : model->parameters()) {
    float* d = p.param->value.data<float>();
    for (int64_t i = 0; i < p.param->value.numel(); ++i) d[i] = (v += 1e-3f);
  }
  for (auto& b : model->buffers()) {
    if (b.buffer->dtype() == DType::Int64) {
      b.buffer->data<int64_t>()[0] = 7;
    } else {
      float* d = b.buffer->data<float>();
      for (int64_t i = 0; i < b.buffer->numel(); ++i) d[i] = (v += 1e-3f);
    }
  }
  model->eval();
  std::vector<std::pair<std::string, std::vector<float>>> params_before, buffers_before;
  for (auto& p : model->parameters())
    params_before.emplace_back(p.name, p.param->value.to_vector<float>());
  std::vector<std::string> buffer_names_before;
  for (auto& b : model->buffers()) {
    buffer_names_before.push_back(b.name);
    if (b.buffer->dtype() == DType::Float32)
      buffers_before.emplace_back(b.name, b.buffer->to_vector<float>());
  }

  // d2l's ResNet-18: the stem's BatchNorm plus bn1 and bn2 in each of the 8 residual
  // blocks (its 1x1 projection shortcuts have no BatchNorm, unlike torchvision's).
  const int replaced = convert_sync_batchnorm(*model, solo.group);
  CHECK(replaced == 1 + 8 * 2);

  int sync_count = 0;
  for (auto& [name, module] : model->named_modules()) {
    CHECK(module->type_name() != "BatchNorm2d");
    if (auto* sync = dynamic_cast<SyncBatchNorm*>(module)) {
      ++sync_count;
      CHECK_FALSE(sync->is_training());
      CHECK(sync->num_batches_tracked() == 7);
    }
  }
  CHECK(sync_count == replaced);

  const auto params = model->parameters();
  REQUIRE(params.size() == params_before.size());
  for (size_t i = 0; i < params.size(); ++i) {
    CHECK(params[i].name == params_before[i].first);
    CHECK(params[i].param->value.to_vector<float>() == params_before[i].second);
  }
  std::vector<std::string> buffer_names;
  size_t float_buffer = 0;
  for (auto& b : model->buffers()) {
    buffer_names.push_back(b.name);
    if (b.buffer->dtype() == DType::Float32) {
      CHECK(b.buffer->to_vector<float>() == buffers_before[float_buffer++].second);
    }
  }
  CHECK(buffer_names == buffer_names_before);
  CHECK(buffer_names.front() == "0.1.running_mean");

  CHECK(convert_sync_batchnorm(*model, solo.group) == 0);  // already converted
  BatchNorm2d lone(3);
  CHECK_THROWS_WITH(convert_sync_batchnorm(lone, solo.group),
                    Catch::Contains("root module is itself a BatchNorm2d"));
  CHECK_THROWS_AS(convert_sync_batchnorm(*model, nullptr), InvalidArgument);
}

TEST_CASE("convert_sync_batchnorm puts the new layers on the model's device") {
  SoloGroup solo;
  // A stand-in for a GPU that the CPU kernels can run on: another host device.
  const Device other = Device::cpu(1);
  auto with_bn = std::make_unique<Sequential>();
  with_bn->append(std::make_unique<BatchNorm2d>(3));
  with_bn->eval();
  with_bn->to(other);
  REQUIRE(convert_sync_batchnorm(*with_bn, solo.group) == 1);
  auto& sync = dynamic_cast<SyncBatchNorm&>(with_bn->child(0));
  CHECK_FALSE(sync.is_training());
  for (const NamedParameter& p : with_bn->parameters()) CHECK(p.param->value.device() == other);
  for (const NamedParameter& p : with_bn->parameters()) CHECK(p.param->grad.device() == other);
  for (const NamedBuffer& b : with_bn->buffers()) CHECK(b.buffer->device() == other);
  // Eval mode never communicates, so the solo Gloo group never sees a cpu:1 tensor.
  const Tensor y = with_bn->forward(Tensor::zeros({2, 3, 2, 2}, DType::Float32, other));
  CHECK(y.device() == other);
}

TEST_CASE("SyncBatchNorm on 3 ranks with batches 0, 4, 2 matches one process on all 6") {
  TempDir dir;
  const auto r = launch(3, "0,4,2", "5x3", dir);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 0);
  for (int rank = 0; rank < 3; ++rank) {
    CHECK_THAT(r.out, Catch::Contains("rank " + std::to_string(rank) + ": OK"));
  }
}

TEST_CASE("SyncBatchNorm on 2 ranks with batches 5, 1 of 1x1 images matches one process") {
  // Rank 1 holds a single value per channel: legal, because only the global count must
  // exceed one (torch issue #36865).
  TempDir dir;
  const auto r = launch(2, "5,1", "1x1", dir);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("rank 0: OK"));
  CHECK_THAT(r.out, Catch::Contains("rank 1: OK"));
}

TEST_CASE("SyncBatchNorm on 2 ranks with a global batch of one fails clearly on every rank") {
  TempDir dir;
  const auto r = launch(2, "1,0", "1x1", dir);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code != 0);
  CHECK(r.seconds < 15);  // no rank is left waiting for a collective
  CHECK_THAT(r.err, Catch::Contains("SyncBatchNorm(3, eps=1e-05, momentum=0.1): expected more "
                                    "than 1 value per channel when training, got global batch "
                                    "of 1 across 2 ranks"));
  CHECK_THAT(r.out, !Catch::Contains(": OK"));
}
