// Elementwise ops, matmul and the linear layer against references and finite
// differences; thread-count control.
#include <catch2/catch.hpp>

#include <omp.h>

#include <cmath>
#include <thread>

#include "core/error.h"
#include "tensor/ops.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;

TEST_CASE("add, add_ and scale_ compute elementwise, with aliasing", "[elementwise]") {
  // Large enough to take the parallel path as well.
  const int64_t n = GENERATE(5, 100003);
  const Tensor a = random_tensor({n}, 1), b = random_tensor({n}, 2);
  std::vector<double> sum(static_cast<size_t>(n)), axpy(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = static_cast<double>(a.data<float>()[i]) + b.data<float>()[i];
    axpy[i] = a.data<float>()[i] + 0.5 * b.data<float>()[i];
  }
  Tensor out = Tensor::empty({n});
  ops::add(a, b, out);
  require_close(out, sum);
  Tensor alias = a.clone();
  ops::add(alias, b, alias);  // out aliases a
  require_close(alias, sum);
  alias = b.clone();
  ops::add(a, alias, alias);  // out aliases b
  require_close(alias, sum);

  Tensor acc = a.clone();
  ops::add_(acc, b, 0.5f);
  require_close(acc, axpy);
  ops::scale_(acc, -2.0f);
  for (double& v : axpy) v *= -2.0;
  require_close(acc, axpy);

  Tensor wrong = Tensor::empty({n + 1});
  CHECK_THROWS_WITH(ops::add(a, b, wrong), Catch::Contains("add") && Catch::Contains("out"));
}

TEST_CASE("relu and sigmoid forward match their formulas; backward matches finite differences",
          "[elementwise]") {
  Tensor x = random_tensor({4, 37}, 3, -4.0f, 4.0f);
  Tensor y = Tensor::empty(x.shape());
  const Tensor r = random_tensor(x.shape(), 4);
  Tensor dx = Tensor::empty(x.shape());

  ops::relu_forward(x, y);
  std::vector<double> expected;
  for (float v : x.to_vector<float>()) expected.push_back(v > 0 ? v : 0.0);
  require_close(y, expected, 0, 0);
  ops::relu_backward(y, r, dx);
  auto relu_loss = [&] {
    ops::relu_forward(x, y);
    return testing::dot(y, r);
  };
  require_close(dx, testing::finite_difference(x, relu_loss, 1e-3f), 1e-3, 1e-3);

  ops::sigmoid_forward(x, y);
  expected.clear();
  for (float v : x.to_vector<float>()) expected.push_back(1.0 / (1.0 + std::exp(-double(v))));
  require_close(y, expected, 1e-6, 1e-6);
  ops::sigmoid_backward(y, r, dx);
  auto sigmoid_loss = [&] {
    ops::sigmoid_forward(x, y);
    return testing::dot(y, r);
  };
  require_close(dx, testing::finite_difference(x, sigmoid_loss, 1e-2f), 1e-3, 1e-3);

  // Saturation gives exact 0 and 1, never NaN.
  const Tensor extreme = Tensor::from_vector<float>({-1000.0f, 1000.0f}, {2});
  Tensor s = Tensor::empty({2});
  ops::sigmoid_forward(extreme, s);
  CHECK(s.to_vector<float>() == std::vector<float>{0.0f, 1.0f});
}

TEST_CASE("permute reorders dimensions as torch.permute does", "[elementwise][channels]") {
  // A channel shuffle, [N, groups, C / groups, HW] -> [N, C / groups, groups, HW]: output
  // channel j * groups + g is input channel g * (C / groups) + j.
  const int64_t hw = GENERATE(int64_t{3}, int64_t{4099});
  const Tensor x = random_tensor({2, 2, 3, hw}, 4);
  Tensor y = Tensor::empty({2, 3, 2, hw});
  ops::permute(x, {0, 2, 1, 3}, y);
  for (int64_t n = 0; n < 2; ++n) {
    for (int64_t j = 0; j < 3; ++j) {
      for (int64_t g = 0; g < 2; ++g) {
        for (int64_t i = 0; i < hw; i += 997) {
          REQUIRE(y.data<float>()[((n * 3 + j) * 2 + g) * hw + i] == x.data<float>()[((n * 2 + g) * 3 + j) * hw + i]);
        }
      }
    }
  }
  // The full reversal of 3 dimensions, and back again by the inverse permutation.
  const Tensor small = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {1, 2, 3});
  Tensor reversed = Tensor::empty({3, 2, 1});
  ops::permute(small, {2, 1, 0}, reversed);
  CHECK(reversed.to_vector<float>() == std::vector<float>{0, 3, 1, 4, 2, 5});
  Tensor back = Tensor::empty({1, 2, 3});
  ops::permute(reversed, {2, 1, 0}, back);
  CHECK(back.to_vector<float>() == small.to_vector<float>());
  CHECK_THROWS_AS(ops::permute(small, {0, 0, 1}, reversed), InternalError);  // no permutation
  CHECK_THROWS_AS(ops::permute(small, {1, 0, 2}, reversed), InternalError);  // y of another shape
}

TEST_CASE("copy_channels moves a block of channels between tensors of one batch and image size",
          "[elementwise][channels]") {
  // Two inputs concatenated along the channels and taken apart again (Concat's forward and
  // backward), large enough for the parallel path too.
  const int64_t hw = GENERATE(int64_t{3}, int64_t{4099});
  const Tensor a = random_tensor({2, 3, hw}, 1), b = random_tensor({2, 5, hw}, 2);
  Tensor both = Tensor::empty({2, 8, hw});
  ops::copy_channels(a, 0, both, 0, 3);
  ops::copy_channels(b, 0, both, 3, 5);
  for (int64_t n = 0; n < 2; ++n) {
    for (int64_t c = 0; c < 8; ++c) {
      const Tensor& from = c < 3 ? a : b;
      const int64_t fc = c < 3 ? c : c - 3, fcs = c < 3 ? 3 : 5;
      for (int64_t i = 0; i < hw; i += 997) {
        REQUIRE(both.data<float>()[(n * 8 + c) * hw + i] == from.data<float>()[(n * fcs + fc) * hw + i]);
      }
    }
  }
  Tensor middle = Tensor::empty({2, 2, hw});
  ops::copy_channels(both, 2, middle, 0, 2);  // a's last channel, b's first
  CHECK(middle.data<float>()[0] == a.data<float>()[2 * hw]);
  CHECK(middle.data<float>()[hw] == b.data<float>()[0]);
  CHECK(middle.data<float>()[3 * hw] == b.data<float>()[5 * hw]);  // second image, b's first channel
  CHECK_THROWS_AS(ops::copy_channels(b, 0, both, 4, 5), InternalError);  // past the end
  CHECK_THROWS_AS(ops::copy_channels(random_tensor({3, 5, hw}, 3), 0, both, 3, 5), InternalError);  // another N
}

TEST_CASE("mul, scale_channels and channel_dot against their definitions", "[elementwise][channels]") {
  const Tensor a = random_tensor({2, 3, 5}, 4), b = random_tensor({2, 3, 5}, 5), s = random_tensor({2, 3, 1}, 6);
  Tensor prod = Tensor::empty({2, 3, 5}), scaled = Tensor::empty({2, 3, 5}), dot = Tensor::empty({2, 3, 1});
  ops::mul(a, b, prod);
  ops::scale_channels(a, s, scaled);
  ops::channel_dot(a, b, dot);
  for (int64_t plane = 0; plane < 6; ++plane) {
    double sum = 0.0;
    for (int64_t i = 0; i < 5; ++i) {
      const int64_t k = plane * 5 + i;
      REQUIRE(prod.data<float>()[k] == a.data<float>()[k] * b.data<float>()[k]);
      REQUIRE(scaled.data<float>()[k] == a.data<float>()[k] * s.data<float>()[plane]);
      sum += static_cast<double>(a.data<float>()[k]) * b.data<float>()[k];
    }
    CHECK(dot.data<float>()[plane] == static_cast<float>(sum));
  }
  // One value per channel, shared by both images: the scale of channel c, and the sum over
  // the images of channel c's products.
  const Tensor per_channel = random_tensor({3}, 7);
  Tensor shared = Tensor::empty({3});
  ops::scale_channels(a, per_channel, scaled);
  ops::channel_dot(a, b, shared);
  for (int64_t c = 0; c < 3; ++c) {
    double sum = 0.0;
    for (int64_t n = 0; n < 2; ++n) {
      for (int64_t i = 0; i < 5; ++i) {
        const int64_t k = (n * 3 + c) * 5 + i;
        REQUIRE(scaled.data<float>()[k] == a.data<float>()[k] * per_channel.data<float>()[c]);
        sum += static_cast<double>(a.data<float>()[k]) * b.data<float>()[k];
      }
    }
    CHECK(shared.data<float>()[c] == static_cast<float>(sum));
  }
  Tensor wrong = Tensor::empty({2, 2, 1});
  CHECK_THROWS_AS(ops::scale_channels(a, wrong, scaled), InternalError);
  CHECK_THROWS_AS(ops::channel_dot(a, b, wrong), InternalError);
}

TEST_CASE("layer_norm_forward and backward against their definitions", "[elementwise][norm]") {
  const Tensor x = random_tensor({4, 7}, 8), w = random_tensor({7}, 9), b = random_tensor({7}, 10);
  const Tensor dy = random_tensor({4, 7}, 11);
  Tensor y = Tensor::empty({4, 7}), mean = Tensor::empty({4}), rstd = Tensor::empty({4});
  ops::layer_norm_forward(x, w, b, 1e-5f, y, mean, rstd);
  Tensor dx = Tensor::empty({4, 7}), dw = Tensor::full({7}, 9.0f), db = Tensor::full({7}, 9.0f);
  ops::layer_norm_backward(x, dy, w, mean, rstd, dx, dw, db);
  std::vector<double> dw_ref(7, 0.0), db_ref(7, 0.0);
  for (int64_t r = 0; r < 4; ++r) {
    const float* row = x.data<float>() + r * 7;
    double m = 0.0, v = 0.0;
    for (int64_t i = 0; i < 7; ++i) m += row[i] / 7.0;
    for (int64_t i = 0; i < 7; ++i) v += (row[i] - m) * (row[i] - m) / 7.0;
    const double s = 1.0 / std::sqrt(v + 1e-5);
    CHECK(mean.data<float>()[r] == Approx(m).epsilon(1e-6));
    CHECK(rstd.data<float>()[r] == Approx(s).epsilon(1e-6));
    // dx = s * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w.
    double g_mean = 0.0, gx_mean = 0.0;
    for (int64_t i = 0; i < 7; ++i) {
      const double g = static_cast<double>(dy.data<float>()[r * 7 + i]) * w.data<float>()[i];
      g_mean += g / 7.0;
      gx_mean += g * (row[i] - m) * s / 7.0;
    }
    for (int64_t i = 0; i < 7; ++i) {
      const double xhat = (row[i] - m) * s, g = static_cast<double>(dy.data<float>()[r * 7 + i]) * w.data<float>()[i];
      CHECK(y.data<float>()[r * 7 + i] == Approx(xhat * w.data<float>()[i] + b.data<float>()[i]).margin(1e-6));
      CHECK(dx.data<float>()[r * 7 + i] == Approx(s * (g - g_mean - xhat * gx_mean)).margin(1e-5));
      dw_ref[static_cast<size_t>(i)] += dy.data<float>()[r * 7 + i] * xhat;
      db_ref[static_cast<size_t>(i)] += dy.data<float>()[r * 7 + i];
    }
  }
  for (int64_t i = 0; i < 7; ++i) {
    CHECK(dw.data<float>()[i] == Approx(dw_ref[static_cast<size_t>(i)]).margin(1e-5));
    CHECK(db.data<float>()[i] == Approx(db_ref[static_cast<size_t>(i)]).margin(1e-5));
  }
  Tensor short_w = Tensor::empty({6});
  CHECK_THROWS_AS(ops::layer_norm_forward(x, short_w, b, 1e-5f, y, mean, rstd), InternalError);
}

TEST_CASE("dropout_mask keeps 1 - p of the elements, scaled by 1 / (1 - p), the same for a seed",
          "[elementwise][dropout]") {
  Tensor mask = Tensor::empty({100000}), again = Tensor::empty({100000}), other = Tensor::empty({100000});
  ops::dropout_mask(mask, 0.2f, 7);
  ops::dropout_mask(again, 0.2f, 7);
  ops::dropout_mask(other, 0.2f, 8);
  int64_t kept = 0, same = 0;
  for (int64_t i = 0; i < mask.numel(); ++i) {
    const float m = mask.data<float>()[i];
    REQUIRE((m == 0.0f || m == 1.0f / 0.8f));
    kept += m != 0.0f;
    REQUIRE(again.data<float>()[i] == m);
    same += other.data<float>()[i] == m;
  }
  CHECK(std::abs(static_cast<double>(kept) / 100000 - 0.8) < 0.01);  // 7.9 standard deviations
  CHECK(same < 75000);  // another seed draws another mask (0.68 agree by chance)
  ops::dropout_mask(mask, 0.0f, 7);
  CHECK(mask.data<float>()[123] == 1.0f);
  CHECK_THROWS_AS(ops::dropout_mask(mask, 1.0f, 7), InternalError);
}

TEST_CASE("matmul handles every transpose combination with alpha and beta", "[matmul]") {
  const bool ta = GENERATE(false, true);
  const bool tb = GENERATE(false, true);
  const int64_t m = 7, k = 5, n = 3;
  const Tensor a = ta ? random_tensor({k, m}, 5) : random_tensor({m, k}, 5);
  const Tensor b = tb ? random_tensor({n, k}, 6) : random_tensor({k, n}, 6);
  const Tensor c0 = random_tensor({m, n}, 7);
  Tensor c = c0.clone();
  ops::matmul(a, ta, b, tb, c, 1.5f, 0.5f);
  require_close(c, testing::matmul_ref(a, ta, b, tb, c0, 1.5f, 0.5f), 1e-5, 1e-5);
  // beta = 0 ignores whatever c held (even NaN).
  c.fill_(NAN);
  ops::matmul(a, ta, b, tb, c);
  require_close(c, testing::matmul_ref(a, ta, b, tb, c0, 1.0f, 0.0f), 1e-5, 1e-5);

  Tensor wrong = Tensor::empty({m, n + 1});
  CHECK_THROWS_WITH(ops::matmul(a, ta, b, tb, wrong), Catch::Contains("matmul"));
  const Tensor bad_b = random_tensor({k + 1, k + 1}, 8);
  CHECK_THROWS_AS(ops::matmul(a, ta, bad_b, tb, c), InternalError);
}

TEST_CASE("matmul with an empty inner dimension gives beta * c", "[matmul]") {
  // dnnl_sgemm rejects the leading dimension 0 of an [m, 0] operand and, with a legal
  // one, leaves c untouched even for beta = 0; an empty sum must still give beta * c.
  const Tensor a = Tensor::empty({3, 0});
  const Tensor b = Tensor::empty({0, 2});
  Tensor c = Tensor::full({3, 2}, 4.0f);
  ops::matmul(a, false, b, false, c, 1.0f, 0.5f);
  CHECK(c.to_vector<float>() == std::vector<float>(6, 2.0f));
  c.fill_(NAN);
  ops::matmul(a, false, b, false, c);
  CHECK(c.to_vector<float>() == std::vector<float>(6, 0.0f));
  const Tensor at = Tensor::empty({0, 3});
  const Tensor bt = Tensor::empty({2, 0});
  ops::matmul(at, true, bt, true, c, 1.0f, 0.0f);
  CHECK(c.to_vector<float>() == std::vector<float>(6, 0.0f));
}

TEST_CASE("linear forward and backward", "[matmul]") {
  Tensor x = random_tensor({6, 5}, 9);
  Tensor w = random_tensor({4, 5}, 10);
  Tensor b = random_tensor({4}, 11);
  Tensor y = Tensor::empty({6, 4});
  ops::linear_forward(x, w, b, y);
  std::vector<double> expected = testing::matmul_ref(x, false, w, true, y, 1.0f, 0.0f);
  for (size_t i = 0; i < expected.size(); ++i) expected[i] += b.data<float>()[i % 4];
  require_close(y, expected, 1e-5, 1e-5);

  const Tensor r = random_tensor(y.shape(), 12);
  auto loss = [&] {
    ops::linear_forward(x, w, b, y);
    return testing::dot(y, r);
  };
  Tensor dx = Tensor::empty(x.shape()), dw = Tensor::full(w.shape(), 9.0f),
         db = Tensor::full({4}, 9.0f);
  ops::linear_backward(x, w, r, dx, dw, db, /*accumulate=*/false);
  const auto fd_x = testing::finite_difference(x, loss, 0.5f);
  const auto fd_w = testing::finite_difference(w, loss, 0.5f);
  const auto fd_b = testing::finite_difference(b, loss, 0.5f);
  require_close(dx, fd_x, 1e-4, 1e-4);
  require_close(dw, fd_w, 1e-4, 1e-4);
  require_close(db, fd_b, 1e-4, 1e-4);

  // Accumulation adds onto the existing gradients; dx may be skipped.
  Tensor no_dx;
  ops::linear_backward(x, w, r, no_dx, dw, db, /*accumulate=*/true);
  std::vector<double> twice_w = fd_w, twice_b = fd_b;
  for (double& v : twice_w) v *= 2;
  for (double& v : twice_b) v *= 2;
  require_close(dw, twice_w, 2e-4, 1e-4);
  require_close(db, twice_b, 2e-4, 1e-4);

  Tensor bad_w = random_tensor({4, 6}, 13);
  CHECK_THROWS_WITH(ops::linear_forward(x, bad_w, b, y), Catch::Contains("linear_forward"));
}

TEST_CASE("set_num_threads reaches OpenMP in every thread that runs a kernel", "[threads]") {
  const int before = ops::num_threads();
  CHECK_THROWS_AS(ops::set_num_threads(0), InvalidArgument);
  // A count that differs from the default, so a thread that never saw the setting
  // would report something else.
  const int wanted = before == 3 ? 2 : 3;
  ops::set_num_threads(wanted);
  CHECK(ops::num_threads() == wanted);
  CHECK(omp_get_max_threads() == wanted);
  int seen_in_worker = 0;
  std::thread worker([&] {
    Tensor t = Tensor::full({8}, 1.0f);
    ops::scale_(t, 2.0f);  // any kernel applies the setting to its thread
    seen_in_worker = omp_get_max_threads();
  });
  worker.join();
  CHECK(seen_in_worker == wanted);
  ops::set_num_threads(before);
  CHECK(omp_get_max_threads() == before);
}
