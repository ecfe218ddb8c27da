// Batch norm kernels against a reference, and the composed forward/backward against
// finite differences (see Note [Separable batch norm] in tensor/ops.h).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "tensor/ops.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;
using mtrain::testing::require_same_bits;

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

// Note [Fused batch norm] in tensor/ops.h: each fused op does its unfused sequence's
// operations in the same order, so the results are the same bits.
TEST_CASE("the batch norm ops fused with a ReLU give the unfused sequence's bits", "[batchnorm]") {
  const Shape shape =
      GENERATE(Shape{4, 3, 5, 7}, Shape{2, 5, 1, 1}, Shape{64, 2, 12, 12}, Shape{37, 11});
  const bool with_affine = GENERATE(true, false);
  CAPTURE(shape_str(shape), with_affine);
  const int64_t c = shape[1];
  const Tensor x = random_tensor(shape, 60, -2.0f, 2.0f);
  const Tensor residual = random_tensor(shape, 61);
  const Tensor dy = random_tensor(shape, 62);
  const Tensor mean = random_tensor({c}, 63, -0.5f, 0.5f);
  const Tensor invstd = random_tensor({c}, 64, 0.5f, 2.0f);
  const Tensor gamma = with_affine ? random_tensor({c}, 65, 0.5f, 1.5f) : Tensor();
  const Tensor beta = with_affine ? random_tensor({c}, 66) : Tensor();

  for (const bool add : {false, true}) {
    CAPTURE(add);
    // Forward: apply, add, relu.
    Tensor bn = Tensor::empty(shape), sum = Tensor::empty(shape), unfused = Tensor::empty(shape);
    ops::batchnorm_apply(x, mean, invstd, gamma, beta, bn);
    if (add) ops::add(bn, residual, sum);
    ops::relu_forward(add ? sum : bn, unfused);
    Tensor fused = Tensor::empty(shape);
    ops::batchnorm_apply_relu(x, mean, invstd, gamma, beta, add ? residual : Tensor(), fused);
    require_same_bits(fused, unfused);
    // Both signs occur, so the mask matters.
    CHECK(std::count(fused.data<float>(), fused.data<float>() + fused.numel(), 0.0f) > 0);

    // Backward: relu_backward, then the reduce and the apply over its result.
    Tensor g = Tensor::empty(shape);
    ops::relu_backward(unfused, dy, g);
    Tensor sum_dy = Tensor::empty({c}), sum_dy_xmu = Tensor::empty({c});
    ops::batchnorm_backward_reduce(g, x, mean, sum_dy, sum_dy_xmu);
    Tensor fused_sum_dy = Tensor::empty({c}), fused_sum_dy_xmu = Tensor::empty({c});
    ops::batchnorm_backward_reduce_relu(dy, fused, x, mean, fused_sum_dy, fused_sum_dy_xmu);
    require_same_bits(fused_sum_dy, sum_dy);
    require_same_bits(fused_sum_dy_xmu, sum_dy_xmu);
    const double local = static_cast<double>(shape[0] * (shape.size() == 4 ? shape[2] * shape[3] : 1));
    for (const double count : {local, 0.0}) {
      Tensor dx = Tensor::empty(shape);
      ops::batchnorm_backward_apply(g, x, mean, invstd, gamma, sum_dy, sum_dy_xmu, count, dx);
      Tensor fused_dx = Tensor::empty(shape), dmasked = Tensor::empty(shape), none;
      ops::batchnorm_backward_apply_relu(dy, fused, x, mean, invstd, gamma, sum_dy, sum_dy_xmu,
                                         count, fused_dx, add ? dmasked : none);
      require_same_bits(fused_dx, dx);
      if (add) require_same_bits(dmasked, g);
    }
  }
}

TEST_CASE("the fused batch norm ops check their extra arguments", "[batchnorm]") {
  const Tensor x = random_tensor({2, 3, 4, 4}, 67);
  const Tensor stats = Tensor::full({3}, 1.0f);
  Tensor y = Tensor::empty(x.shape());
  const Tensor other = Tensor::empty({2, 3, 4, 3});
  CHECK_THROWS_WITH(ops::batchnorm_apply_relu(x, stats, stats, Tensor(), Tensor(), other, y),
                    Catch::Contains("batchnorm_apply_relu") && Catch::Contains("residual"));
  Tensor sums = Tensor::empty({3});
  CHECK_THROWS_WITH(ops::batchnorm_backward_reduce_relu(x, other, x, stats, sums, sums),
                    Catch::Contains("batchnorm_backward_reduce_relu") && Catch::Contains(": y expected"));
  Tensor dx = Tensor::empty(x.shape()), wrong = Tensor::empty({3});
  CHECK_THROWS_WITH(
      ops::batchnorm_backward_apply_relu(x, y, x, stats, stats, Tensor(), stats, stats, 4.0, dx, wrong),
      Catch::Contains("dmasked"));
}
