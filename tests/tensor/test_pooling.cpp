// Pooling: hand-computed cases, the naive reference, and finite differences.
#include <catch2/catch.hpp>

#include <cmath>

#include "core/error.h"
#include "tensor/ops.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::ops::Pool2dParams;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;

namespace {

Tensor iota(const Shape& shape, float start, float step = 1.0f) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + step * static_cast<float>(i);
  return t;
}

Shape pooled_shape(const Tensor& x, const Pool2dParams& p) {
  return {x.size(0), x.size(1), ops::pool_out_size(x.size(2), p.kernel_h, p.stride_h, p.pad_h, p.ceil_mode),
          ops::pool_out_size(x.size(3), p.kernel_w, p.stride_w, p.pad_w, p.ceil_mode)};
}

std::vector<int32_t> maxpool(const Tensor& x, Tensor& y, const Pool2dParams& p) {
  y = Tensor::empty(pooled_shape(x, p));
  Tensor idx = Tensor::empty(y.shape(), DType::Int32);
  ops::maxpool2d_forward(x, y, idx, p);
  return idx.to_vector<int32_t>();
}

}  // namespace

TEST_CASE("maxpool2d_forward matches hand-computed results", "[pool]") {
  Tensor y;
  SECTION("2x2 stride 2") {
    const Tensor x = Tensor::from_vector<float>(
        {1, 5, 2, 0, 3, 4, 8, 1, 0, -1, 6, 7, -2, -3, 9, 2}, {1, 1, 4, 4});
    CHECK(maxpool(x, y, {}) == std::vector<int32_t>{1, 6, 8, 14});
    require_close(y, {5, 8, 0, 9});
  }
  SECTION("3x3 stride 2 padding 1 (ResNet stem): padding is -inf, not 0") {
    // x = -1, -2, ..., -16: every window's max is its top-left real element.
    const Tensor x = iota({1, 1, 4, 4}, -1.0f, -1.0f);
    CHECK(maxpool(x, y, {3, 3, 2, 2, 1, 1}) == std::vector<int32_t>{0, 1, 4, 5});
    require_close(y, {-1, -2, -5, -6});
    // x = 1..16: the bottom-right real element wins.
    const Tensor up = iota({1, 1, 4, 4}, 1.0f);
    CHECK(maxpool(up, y, {3, 3, 2, 2, 1, 1}) == std::vector<int32_t>{5, 7, 13, 15});
    require_close(y, {6, 8, 14, 16});
  }
  SECTION("indices are per plane; non-square kernel and stride") {
    // Two planes; kernel 1x2 stride 1x2 over 2x4 planes.
    const Tensor x = Tensor::from_vector<float>(
        {1, 2, 4, 3, 0, 0, -1, -2, 9, 8, 7, 6, 5, 4, 3, 2}, {1, 2, 2, 4});
    CHECK(maxpool(x, y, {1, 2, 1, 2, 0, 0}) == std::vector<int32_t>{1, 2, 4, 6, 0, 2, 4, 6});
    require_close(y, {2, 4, 0, -1, 9, 7, 5, 3});
  }
}

TEST_CASE("pool_out_size rounds as PyTorch's ceil_mode does", "[pool]") {
  // Sizes from torch.nn.functional.max_pool2d(..., ceil_mode=True) (PyTorch 1.13).
  struct Case {
    int64_t in, k, s, p, ceil, floor;
  };
  for (const Case& c : {Case{14, 3, 2, 0, 7, 6}, Case{1, 2, 2, 0, 1, 0}, Case{5, 3, 2, 1, 3, 3},
                        Case{6, 2, 2, 1, 4, 4}, Case{5, 2, 2, 1, 3, 3}, Case{4, 3, 2, 0, 2, 1}}) {
    CAPTURE(c.in, c.k, c.s, c.p);
    CHECK(ops::pool_out_size(c.in, c.k, c.s, c.p, true) == c.ceil);
    CHECK(ops::pool_out_size(c.in, c.k, c.s, c.p, false) == c.floor);
    CHECK(ops::pool_out_size(c.in, c.k, c.s, c.p, false) == ops::conv_out_size(c.in, c.k, c.s, c.p));
  }
}

TEST_CASE("maxpool2d_forward in ceil mode clips the last window to the input", "[pool]") {
  // 1..16 in a 4x4 plane, 3x3 windows at stride 2: the second row and column of windows
  // start inside and end past the input (PyTorch: values 11 12 15 16, indices 10 11 14 15).
  Pool2dParams p{3, 3, 2, 2, 0, 0};
  p.ceil_mode = true;
  Tensor y;
  CHECK(maxpool(iota({1, 1, 4, 4}, 1.0f), y, p) == std::vector<int32_t>{10, 11, 14, 15});
  require_close(y, {11, 12, 15, 16});
  Tensor avg = Tensor::empty(y.shape());
  CHECK_THROWS_AS(ops::avgpool2d_forward(iota({1, 1, 4, 4}, 1.0f), avg, p), InternalError);
}

TEST_CASE("maxpool2d_forward propagates NaN like PyTorch", "[pool]") {
  const Tensor x = Tensor::from_vector<float>({1, NAN, 3, 2}, {1, 1, 2, 2});
  Tensor y;
  CHECK(maxpool(x, y, {}) == std::vector<int32_t>{1});
  CHECK(std::isnan(y.data<float>()[0]));
}

TEST_CASE("maxpool2d_forward picks the first maximum and the last NaN, like a row-major scan", "[pool]") {
  // Values from {0, 1, 2} tie often (as after a ReLU); NaN and -inf appear here and
  // there; odd sizes and every stride leave clipped windows at both edges.
  const Pool2dParams p = GENERATE(Pool2dParams{}, Pool2dParams{3, 3, 2, 2, 1, 1},
                                  Pool2dParams{3, 2, 1, 2, 1, 0}, Pool2dParams{2, 3, 1, 3, 0, 1},
                                  Pool2dParams{3, 3, 1, 1, 1, 1}, Pool2dParams{2, 2, 1, 1, 0, 0});
  const int64_t h = 9, w = 11;
  Tensor x = Tensor::empty({2, 3, h, w});
  float* px = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t r = (i * 7919 + 13) % 101;
    px[i] = r == 0 ? NAN : r == 1 ? -INFINITY : static_cast<float>(r % 3);
  }
  for (int64_t i = 0; i < 2 * 3 * w; i += 5) px[i] = -INFINITY;  // some all -inf windows near row 0
  Tensor y;
  const std::vector<int32_t> got = maxpool(x, y, p);
  const int64_t oh = y.size(2), ow = y.size(3);
  size_t k = 0;
  for (int64_t plane = 0; plane < 6; ++plane) {
    for (int64_t oy = 0; oy < oh; ++oy) {
      for (int64_t ox = 0; ox < ow; ++ox, ++k) {
        // The naive scan: the window in row-major order; strictly greater or NaN wins.
        float best = -INFINITY;
        int64_t best_at = -1;
        for (int64_t ky = 0; ky < p.kernel_h; ++ky) {
          for (int64_t kx = 0; kx < p.kernel_w; ++kx) {
            const int64_t iy = oy * p.stride_h - p.pad_h + ky, ix = ox * p.stride_w - p.pad_w + kx;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
            const float v = px[plane * h * w + iy * w + ix];
            if (best_at < 0) best_at = iy * w + ix;  // an all -inf window reports its first element
            if (v > best || std::isnan(v)) {
              best = v;
              best_at = iy * w + ix;
            }
          }
        }
        INFO("plane " << plane << " output (" << oy << ", " << ox << ")");
        REQUIRE(got[k] == best_at);
        const float out = y.data<float>()[k];
        REQUIRE(((std::isnan(out) && std::isnan(best)) || out == best));
      }
    }
  }
}

TEST_CASE("avgpool2d_forward matches hand-computed results", "[pool]") {
  SECTION("2x2 stride 2") {
    const Tensor x = iota({1, 1, 2, 4}, 1.0f);  // [[1,2,3,4],[5,6,7,8]]
    Tensor y = Tensor::empty({1, 1, 1, 2});
    ops::avgpool2d_forward(x, y, {});
    require_close(y, {3.5, 5.5});
  }
  SECTION("3x3 stride 1 padding 1 divides by 9 everywhere (count_include_pad)") {
    const Tensor x = iota({1, 1, 3, 3}, 1.0f);
    Tensor y = Tensor::empty({1, 1, 3, 3});
    ops::avgpool2d_forward(x, y, {3, 3, 1, 1, 1, 1});
    require_close(y, {12 / 9.0, 21 / 9.0, 16 / 9.0, 27 / 9.0, 45 / 9.0, 33 / 9.0, 24 / 9.0,
                      39 / 9.0, 28 / 9.0});
  }
  SECTION("global average pooling") {
    const Tensor x = iota({2, 2, 2, 2}, 0.0f);  // planes 0..3, 4..7, 8..11, 12..15
    Tensor y = Tensor::empty({2, 2, 1, 1});
    ops::global_avgpool_forward(x, y);
    require_close(y, {1.5, 5.5, 9.5, 13.5});
  }
}

TEST_CASE("pooling matches the naive reference on random data", "[pool]") {
  // {} and {3, 3, 3, 3, 0, 0} tile the input (Note [Tiled pooling]), leaving a row
  // and columns that belong to no window.
  const Pool2dParams p = GENERATE(Pool2dParams{}, Pool2dParams{3, 3, 2, 2, 1, 1},
                                  Pool2dParams{3, 2, 1, 2, 1, 0}, Pool2dParams{2, 2, 1, 1, 0, 0},
                                  Pool2dParams{3, 3, 3, 3, 0, 0});
  const Tensor x = random_tensor({3, 4, 9, 8}, 41);
  Tensor y;
  maxpool(x, y, p);
  require_close(y, testing::pool2d_ref(x, p, true), 0, 0);
  Tensor a = Tensor::empty(y.shape());
  ops::avgpool2d_forward(x, a, p);
  require_close(a, testing::pool2d_ref(x, p, false), 1e-6, 1e-6);
}

TEST_CASE("pooling backward ops are the gradients of the forward ops", "[pool]") {
  const Pool2dParams p = GENERATE(Pool2dParams{}, Pool2dParams{3, 3, 2, 2, 1, 1},
                                  Pool2dParams{3, 2, 1, 2, 1, 0}, Pool2dParams{3, 3, 3, 3, 0, 0});
  // Distinct, well-separated values keep every max away from a tie, so a small
  // perturbation never changes which element wins.
  Tensor x = Tensor::empty({2, 3, 7, 6});
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>((i * 37) % 97) * 0.1f;
  const Shape ys = pooled_shape(x, p);
  const Tensor r = random_tensor(ys, 42);

  Tensor y = Tensor::empty(ys), idx = Tensor::empty(ys, DType::Int32);
  auto max_loss = [&] {
    ops::maxpool2d_forward(x, y, idx, p);
    return testing::dot(y, r);
  };
  max_loss();
  Tensor dx = Tensor::full(x.shape(), 3.0f);
  ops::maxpool2d_backward(r, idx, dx);
  require_close(dx, testing::finite_difference(x, max_loss, 0.01f), 1e-3, 1e-3);

  auto avg_loss = [&] {
    ops::avgpool2d_forward(x, y, p);
    return testing::dot(y, r);
  };
  ops::avgpool2d_backward(r, dx, p);
  require_close(dx, testing::finite_difference(x, avg_loss, 0.5f), 1e-4, 1e-3);

  Tensor g = Tensor::empty({2, 3, 1, 1});
  const Tensor rg = random_tensor(g.shape(), 43);
  auto global_loss = [&] {
    ops::global_avgpool_forward(x, g);
    return testing::dot(g, rg);
  };
  ops::global_avgpool_backward(rg, dx);
  require_close(dx, testing::finite_difference(x, global_loss, 0.5f), 1e-4, 1e-3);
}

TEST_CASE("pooling rejects bad shapes and parameters", "[pool]") {
  const Tensor x = random_tensor({1, 2, 4, 4}, 44);
  Tensor y = Tensor::empty({1, 2, 3, 3});  // 2x2 stride 2 gives 2x2
  Tensor idx = Tensor::empty({1, 2, 3, 3}, DType::Int32);
  CHECK_THROWS_WITH(ops::maxpool2d_forward(x, y, idx, {}),
                    Catch::Contains("maxpool2d_forward") && Catch::Contains("[1, 2, 2, 2]"));
  Tensor y2 = Tensor::empty({1, 2, 2, 2});
  Tensor idx_f = Tensor::empty({1, 2, 2, 2});  // float, not int32
  CHECK_THROWS_AS(ops::maxpool2d_forward(x, y2, idx_f, {}), InternalError);
  // Padding above half the kernel would make all-padding windows.
  CHECK_THROWS_AS(ops::avgpool2d_forward(x, y2, {2, 2, 2, 2, 2, 2}), InternalError);
  Tensor bad_idx = Tensor::from_vector<int32_t>({0, 1, 2, 99, 0, 0, 0, 0}, {1, 2, 2, 2});
  Tensor dx = Tensor::empty(x.shape());
  CHECK_THROWS_AS(ops::maxpool2d_backward(y2, bad_idx, dx), InternalError);
}
