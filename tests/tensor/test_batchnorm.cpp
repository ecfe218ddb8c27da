// Batch norm kernels against a reference, and the composed forward/backward against
// finite differences (see Note [Separable batch norm] in tensor/ops.h).
#include <catch2/catch.hpp>

#include <cmath>

#include "core/error.h"
#include "tensor/ops.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;

namespace {

constexpr float kEps = 1e-5f;

// Training-mode batch norm built from the separable kernels.
void batchnorm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& y,
                     Tensor& mean, Tensor& invstd) {
  Tensor var = Tensor::empty(mean.shape());
  ops::batchnorm_stats(x, mean, var);
  for (int64_t c = 0; c < var.numel(); ++c) {
    invstd.data<float>()[c] = 1.0f / std::sqrt(var.data<float>()[c] + kEps);
  }
  ops::batchnorm_apply(x, mean, invstd, gamma, beta, y);
}

}  // namespace

TEST_CASE("batchnorm_stats gives the mean and biased variance per channel", "[batchnorm]") {
  SECTION("hand-computed") {
    // Channel 0 holds 1,2 (n=0) and 5,6 (n=1); channel 1 holds 3,4 and 7,8.
    const Tensor x = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6, 7, 8}, {2, 2, 1, 2});
    Tensor mean = Tensor::empty({2}), var = Tensor::empty({2});
    ops::batchnorm_stats(x, mean, var);
    require_close(mean, {3.5, 5.5});
    require_close(var, {4.25, 4.25});  // ((2.5^2 + 1.5^2) * 2) / 4
  }
  SECTION("reference, including a large offset that would break E[x^2] - E[x]^2") {
    const Shape shape = GENERATE(Shape{8, 3, 5, 7}, Shape{64, 1, 28, 28}, Shape{5, 4});
    Tensor x = random_tensor(shape, 51);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += 1000.0f;
    Tensor mean = Tensor::empty({shape[1]}), var = Tensor::empty({shape[1]});
    ops::batchnorm_stats(x, mean, var);
    const auto ref = testing::batchnorm_stats_ref(x);
    require_close(mean, ref.mean, 1e-4, 1e-6);
    require_close(var, ref.var, 1e-5, 1e-4);
  }
  SECTION("a tiny spread around a large mean: deviations from the exact mean") {
    // 1e6 and its next float, 1e6 + 1/16: the mean 1e6 + 1/48 has no float, and the
    // variance around its rounding would come out 50 % high.
    const Tensor x = Tensor::from_vector<float>({1e6f, 1e6f, 1e6f + 0.0625f}, {3, 1});
    Tensor mean = Tensor::empty({1}), var = Tensor::empty({1});
    ops::batchnorm_stats(x, mean, var);
    const double exact = 2.0 * (0.0625 / 3) * (0.0625 / 3) + (0.125 / 3) * (0.125 / 3);
    CHECK(var.data<float>()[0] == Approx(exact / 3).epsilon(1e-6));
  }
  SECTION("an empty batch gives zeros, not NaN") {
    const Tensor x = Tensor::empty({0, 3, 4, 4});
    Tensor mean = Tensor::full({3}, 7.0f), var = Tensor::full({3}, 7.0f);
    ops::batchnorm_stats(x, mean, var);
    require_close(mean, {0, 0, 0}, 0, 0);
    require_close(var, {0, 0, 0}, 0, 0);
  }
}

TEST_CASE("batchnorm_apply normalises with per-channel scale and shift", "[batchnorm]") {
  const Tensor x = random_tensor({3, 2, 4, 5}, 52);
  const Tensor mean = Tensor::from_vector<float>({0.1f, -0.2f}, {2});
  const Tensor invstd = Tensor::from_vector<float>({2.0f, 0.5f}, {2});
  const Tensor gamma = Tensor::from_vector<float>({1.5f, -1.0f}, {2});
  const Tensor beta = Tensor::from_vector<float>({0.25f, 3.0f}, {2});
  Tensor y = Tensor::empty(x.shape());
  ops::batchnorm_apply(x, mean, invstd, gamma, beta, y);
  std::vector<double> expected;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t c = (i / 20) % 2;
    expected.push_back((x.data<float>()[i] - mean.data<float>()[c]) * invstd.data<float>()[c] *
                           gamma.data<float>()[c] + beta.data<float>()[c]);
  }
  require_close(y, expected, 1e-5, 1e-5);
  CHECK_THROWS_WITH(ops::batchnorm_apply(x, mean, invstd, Tensor::empty({3}), beta, y),
                    Catch::Contains("batchnorm_apply") && Catch::Contains("gamma"));
}

TEST_CASE("batch norm backward is the gradient of the training forward", "[batchnorm]") {
  Tensor x = random_tensor({4, 3, 3, 2}, 53, -2.0f, 2.0f);
  Tensor gamma = random_tensor({3}, 54, 0.5f, 1.5f);
  Tensor beta = random_tensor({3}, 55);
  const Tensor r = random_tensor(x.shape(), 56);
  Tensor y = Tensor::empty(x.shape()), mean = Tensor::empty({3}), invstd = Tensor::empty({3});
  auto loss = [&] {
    batchnorm_train(x, gamma, beta, y, mean, invstd);
    return testing::dot(y, r);
  };
  loss();

  Tensor sum_dy = Tensor::empty({3}), sum_dy_xmu = Tensor::empty({3});
  ops::batchnorm_backward_reduce(r, x, mean, sum_dy, sum_dy_xmu);
  // Reference sums.
  std::vector<double> ref_dy(3), ref_dy_xmu(3);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t c = (i / 6) % 3;
    ref_dy[c] += r.data<float>()[i];
    ref_dy_xmu[c] += r.data<float>()[i] * (x.data<float>()[i] - mean.data<float>()[c]);
  }
  require_close(sum_dy, ref_dy, 1e-5, 1e-5);
  require_close(sum_dy_xmu, ref_dy_xmu, 1e-5, 1e-5);

  Tensor dx = Tensor::empty(x.shape());
  ops::batchnorm_backward_apply(r, x, mean, invstd, gamma, sum_dy, sum_dy_xmu,
                                static_cast<double>(4 * 3 * 2), dx);
  require_close(dx, testing::finite_difference(x, loss, 1e-2f), 2e-3, 2e-3);

  // dgamma = sum_dy_xmu * invstd and dbeta = sum_dy are what the layer derives from
  // the same reductions; check them against finite differences too.
  const auto fd_gamma = testing::finite_difference(gamma, loss, 1e-2f);
  const auto fd_beta = testing::finite_difference(beta, loss, 1e-2f);
  for (int c = 0; c < 3; ++c) {
    CHECK(sum_dy_xmu.data<float>()[c] * invstd.data<float>()[c] ==
          Approx(fd_gamma[c]).margin(2e-3).epsilon(2e-3));
    CHECK(sum_dy.data<float>()[c] == Approx(fd_beta[c]).margin(2e-3).epsilon(2e-3));
  }
}

TEST_CASE("batchnorm_backward_apply in eval mode and with no elements", "[batchnorm]") {
  const Tensor x = random_tensor({2, 2, 2, 2}, 57);
  const Tensor dy = random_tensor(x.shape(), 58);
  const Tensor mean = random_tensor({2}, 59);
  const Tensor invstd = Tensor::from_vector<float>({2.0f, 0.5f}, {2});
  const Tensor gamma = Tensor::from_vector<float>({3.0f, -1.0f}, {2});
  const Tensor zeros = Tensor::zeros({2});
  Tensor dx = Tensor::empty(x.shape());
  // Eval mode: the statistics are constants, dx = gamma * invstd * dy.
  ops::batchnorm_backward_apply(dy, x, mean, invstd, gamma, zeros, zeros, 16.0, dx);
  std::vector<double> expected;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t c = (i / 4) % 2;
    expected.push_back(dy.data<float>()[i] * gamma.data<float>()[c] * invstd.data<float>()[c]);
  }
  require_close(dx, expected, 1e-6, 1e-6);
  // count == 0 must not produce NaN (an empty local batch under SyncBatchNorm).
  const Tensor ones = Tensor::full({2}, 1.0f);
  ops::batchnorm_backward_apply(dy, x, mean, invstd, gamma, ones, ones, 0.0, dx);
  require_close(dx, expected, 1e-6, 1e-6);
}
