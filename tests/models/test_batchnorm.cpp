// BatchNorm2d semantics against torch's formulas: normalisation, running statistics
// (momentum 0.1, unbiased running variance), num_batches_tracked, eval mode, and the
// statistics hooks SyncBatchNorm builds on.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "models/batchnorm.h"
#include "tensor/ops.h"
#include "tests/models/grad_check.h"

using namespace mtrain;
using namespace mtrain::models;
using namespace mtrain::models::testing;

namespace {

struct ChannelStats {
  std::vector<double> mean, biased_var, unbiased_var;
};

// Straight from the definition, in double.
ChannelStats channel_stats(const Tensor& x) {
  const int64_t n = x.size(0), c = x.size(1), hw = x.size(2) * x.size(3);
  const float* p = x.data<float>();
  ChannelStats s;
  for (int64_t ch = 0; ch < c; ++ch) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < hw; ++k) sum += p[(i * c + ch) * hw + k];
    const double count = static_cast<double>(n * hw);
    const double mean = sum / count;
    double sq = 0.0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < hw; ++k) sq += std::pow(p[(i * c + ch) * hw + k] - mean, 2);
    s.mean.push_back(mean);
    s.biased_var.push_back(sq / count);
    s.unbiased_var.push_back(sq / (count - 1));
  }
  return s;
}

float at(const Tensor& t, int64_t i) { return t.data<float>()[i]; }

}  // namespace

TEST_CASE("BatchNorm2d training forward normalises with batch statistics", "[batchnorm]") {
  std::mt19937_64 rng(1);
  BatchNorm2d bn(3);
  bn.weight().value.copy_(Tensor::from_vector<float>({1.0f, 2.0f, 0.5f}, {3}));
  bn.bias().value.copy_(Tensor::from_vector<float>({0.0f, -1.0f, 3.0f}, {3}));
  const Tensor x = uniform_tensor({4, 3, 2, 3}, rng, -2.0f, 3.0f);
  const ChannelStats s = channel_stats(x);
  const Tensor y = bn.forward(x);
  const float* px = x.data<float>();
  const float* py = y.data<float>();
  const double gamma[] = {1.0, 2.0, 0.5}, beta[] = {0.0, -1.0, 3.0};
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t ch = (i / 6) % 3;
    const double expected =
        (px[i] - s.mean[ch]) / std::sqrt(s.biased_var[ch] + 1e-5) * gamma[ch] + beta[ch];
    CHECK(py[i] == Approx(expected).margin(1e-5));
  }
}

TEST_CASE("BatchNorm2d running statistics follow torch (momentum 0.1, unbiased var)",
          "[batchnorm]") {
  std::mt19937_64 rng(2);
  BatchNorm2d bn(2);
  CHECK(bn.num_batches_tracked() == 0);
  std::vector<double> mean(2, 0.0), var(2, 1.0);
  for (int step = 1; step <= 3; ++step) {
    const Tensor x = uniform_tensor({3, 2, 2, 2}, rng, -1.0f, 2.0f);
    const ChannelStats s = channel_stats(x);
    bn.forward(x);
    for (int ch = 0; ch < 2; ++ch) {
      mean[ch] = 0.9 * mean[ch] + 0.1 * s.mean[ch];
      var[ch] = 0.9 * var[ch] + 0.1 * s.unbiased_var[ch];
      CHECK(at(bn.running_mean(), ch) == Approx(mean[ch]).margin(1e-6));
      CHECK(at(bn.running_var(), ch) == Approx(var[ch]).margin(1e-6));
    }
    CHECK(bn.num_batches_tracked() == step);
  }

  // Eval uses the running statistics and leaves them alone.
  bn.eval();
  const Tensor x = uniform_tensor({2, 2, 2, 2}, rng);
  const Tensor y = bn.forward(x);
  CHECK(bn.num_batches_tracked() == 3);
  CHECK(at(bn.running_mean(), 0) == Approx(mean[0]).margin(1e-6));
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t ch = (i / 4) % 2;
    CHECK(at(y, i) == Approx((at(x, i) - mean[ch]) / std::sqrt(var[ch] + 1e-5)).margin(1e-5));
  }
}

TEST_CASE("BatchNorm2d needs more than one value per channel when training", "[batchnorm]") {
  BatchNorm2d bn(2);
  CHECK_THROWS_AS(bn.forward(Tensor::zeros({1, 2, 1, 1})), InvalidArgument);
  CHECK(bn.num_batches_tracked() == 0);
  bn.eval();
  CHECK_NOTHROW(bn.forward(Tensor::zeros({1, 2, 1, 1})));
}

namespace {
// Two identical replicas seen from one of them: the global batch is this batch twice,
// so mean and biased var are unchanged, the count doubles and the backward sums double.
class TwoIdenticalReplicasBatchNorm : public BatchNorm2d {
 public:
  using BatchNorm2d::BatchNorm2d;
  int merges = 0, reductions = 0;

 protected:
  void merge_batch_stats(BatchStats& stats) override {
    ++merges;
    stats.count *= 2;
  }
  void reduce_backward_sums(Tensor& sum_dy, Tensor& sum_dy_xmu) override {
    ++reductions;
    mtrain::ops::scale_(sum_dy, 2.0f);
    mtrain::ops::scale_(sum_dy_xmu, 2.0f);
  }
};
}  // namespace

TEST_CASE("the statistics hooks replace local statistics with merged ones", "[batchnorm]") {
  std::mt19937_64 rng(3);
  const Tensor x = uniform_tensor({2, 2, 2, 2}, rng, -1.0f, 1.0f);
  const Tensor dy = uniform_tensor({2, 2, 2, 2}, rng);
  BatchNorm2d local(2);
  TwoIdenticalReplicasBatchNorm merged(2);
  const Tensor y_local = local.forward(x);
  const Tensor y_merged = merged.forward(x);
  CHECK(merged.merges == 1);
  CHECK(y_merged.to_vector<float>() == y_local.to_vector<float>());
  // The running variance is unbiased with the merged count: n=8 locally, 16 merged.
  const ChannelStats s = channel_stats(x);
  for (int ch = 0; ch < 2; ++ch) {
    CHECK(at(local.running_var(), ch) == Approx(0.9 + 0.1 * s.biased_var[ch] * 8 / 7));
    CHECK(at(merged.running_var(), ch) == Approx(0.9 + 0.1 * s.biased_var[ch] * 16 / 15));
  }
  // Backward: same dx (sums and count both doubled), weight/bias grads from local sums.
  const Tensor dx_local = local.backward(dy);
  const Tensor dx_merged = merged.backward(dy);
  CHECK(merged.reductions == 1);
  for (int64_t i = 0; i < dx_local.numel(); ++i) {
    CHECK(at(dx_merged, i) == Approx(at(dx_local, i)).margin(1e-6));
  }
  CHECK(merged.weight().grad.to_vector<float>() == local.weight().grad.to_vector<float>());
  CHECK(merged.bias().grad.to_vector<float>() == local.bias().grad.to_vector<float>());

  // Eval mode never merges.
  merged.eval();
  merged.forward(x);
  merged.backward(dy);
  CHECK(merged.merges == 1);
  CHECK(merged.reductions == 1);
}

TEST_CASE("copy_state_from carries parameters and all three buffers", "[batchnorm]") {
  std::mt19937_64 rng(4);
  BatchNorm2d source(2);
  source.weight().value.fill_(3.0f);
  source.forward(uniform_tensor({2, 2, 2, 2}, rng));
  source.forward(uniform_tensor({2, 2, 2, 2}, rng));
  BatchNorm2d copy(2);
  copy.copy_state_from(source);
  CHECK(copy.weight().value.to_vector<float>() == source.weight().value.to_vector<float>());
  CHECK(copy.running_mean().to_vector<float>() == source.running_mean().to_vector<float>());
  CHECK(copy.running_var().to_vector<float>() == source.running_var().to_vector<float>());
  CHECK(copy.num_batches_tracked() == 2);
}
