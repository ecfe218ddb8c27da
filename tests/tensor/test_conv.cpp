// Convolution: hand-computed cases, a naive reference across the shapes training uses
// (in both oneDNN layouts), finite differences for the backward ops, and the
// primitive cache's steady state.
#include <catch2/catch.hpp>

#include <omp.h>

#include "core/error.h"
#include "tensor/cpu/conv_support.h"
#include "tensor/cpu/conv_gemm_weights.h"
#include "tensor/cpu/conv_geometry.h"
#include "tensor/cpu/conv_layout.h"
#include "tensor/cpu/conv_lanes.h"
#include "tensor/cpu/conv_winograd.h"
#include "tensor/ops.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::ops::Conv2dParams;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;

namespace {

Tensor iota(const Shape& shape, float start = 1.0f) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = start + static_cast<float>(i);
  return t;
}

Tensor conv(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& p) {
  const int64_t oh = ops::conv_out_size(x.size(2), w.size(2), p.stride_h, p.pad_h, p.dilation_h);
  const int64_t ow = ops::conv_out_size(x.size(3), w.size(3), p.stride_w, p.pad_w, p.dilation_w);
  Tensor y = Tensor::empty({x.size(0), w.size(0), oh, ow});
  ops::conv2d_forward(x, w, b, y, p);
  return y;
}

// conv2d_backward_weights against the reference: overwriting with a bias gradient, then
// accumulating onto ones without one.
void check_weight_gradients(const Tensor& x, const Tensor& w, const Tensor& dy,
                            const Conv2dParams& p) {
  const auto ref = testing::conv2d_backward_ref(x, w, dy, p);
  Tensor dw = Tensor::full(w.shape(), 7.0f);
  Tensor db = Tensor::full({w.size(0)}, 7.0f);
  ops::conv2d_backward_weights(x, dy, dw, db, p, /*accumulate=*/false);
  require_close(dw, ref.dw, 1e-4, 1e-4);
  require_close(db, ref.db, 1e-4, 1e-4);
  Tensor dw_acc = Tensor::full(w.shape(), 1.0f);
  Tensor no_bias;
  ops::conv2d_backward_weights(x, dy, dw_acc, no_bias, p, /*accumulate=*/true);
  std::vector<double> plus_one = ref.dw;
  for (double& v : plus_one) v += 1.0;
  require_close(dw_acc, plus_one, 1e-4, 1e-4);
}

// Sets the intra-op thread count for a test case and restores it when the case ends
// (also when an assertion fails).
struct ThreadsScope {
  explicit ThreadsScope(int n) : before(ops::num_threads()) { ops::set_num_threads(n); }
  ~ThreadsScope() { ops::set_num_threads(before); }
  int before;
};

// What a failing shape loop prints: the shapes, padding and thread count.
std::string describe(const Shape& x, const Shape& w, int pad_h, int pad_w, int threads) {
  return fmt::format("x {} w {} pad {}x{} threads {}", shape_str(x), shape_str(w), pad_h, pad_w, threads);
}

// Restores the default layout policy when a section that changed it ends.
struct LayoutScope {
  explicit LayoutScope(ops::cpu::ConvLayout l) { ops::cpu::set_conv_layout(l); }
  ~LayoutScope() { ops::cpu::set_conv_layout(ops::cpu::ConvLayout::Auto); }
};

}  // namespace

TEST_CASE("conv_out_size follows floor((in + 2p - k) / s) + 1", "[conv]") {
  CHECK(ops::conv_out_size(28, 5, 1, 2) == 28);
  CHECK(ops::conv_out_size(28, 3, 2, 1) == 14);
  CHECK(ops::conv_out_size(7, 3, 2, 1) == 4);
  CHECK(ops::conv_out_size(7, 1, 2, 0) == 4);
  CHECK(ops::conv_out_size(4, 5, 1, 0) == 0);   // kernel larger than the input
  CHECK(ops::conv_out_size(3, 5, 2, 0) == 0);   // not 1: -2/2 truncates to 0
  CHECK_THROWS_AS(ops::conv_out_size(4, 3, 0, 0), InternalError);
  // Dilation 2 spreads a 3-tap kernel over 5 inputs (torch: Conv2d(1, 1, 3, dilation=2) on 9 -> 5).
  CHECK(ops::conv_out_size(9, 3, 1, 0, 2) == 5);
  CHECK(ops::conv_out_size(9, 3, 1, 2, 2) == 9);
  CHECK_THROWS_AS(ops::conv_out_size(9, 3, 1, 0, 0), InternalError);
}

TEST_CASE("conv2d_forward matches hand-computed results", "[conv]") {
  const Tensor none;
  SECTION("2x2 kernel, stride 1, no padding, bias off and on") {
    // x = [[1,2,3],[4,5,6],[7,8,9]], w = [[1,2],[3,4]]:
    // y00 = 1+4+12+20, y01 = 2+6+15+24, y10 = 4+10+21+32, y11 = 5+12+24+36.
    const Tensor x = iota({1, 1, 3, 3});
    const Tensor w = iota({1, 1, 2, 2});
    require_close(conv(x, w, none, {}), {37, 47, 67, 77});
    require_close(conv(x, w, Tensor::full({1}, 0.5f), {}), {37.5, 47.5, 67.5, 77.5});
  }
  SECTION("3x3 ones kernel, padding 1, stride 1 and 2") {
    // Each output is the sum of the (zero-padded) 3x3 neighbourhood of x = 1..9.
    const Tensor x = iota({1, 1, 3, 3});
    const Tensor w = Tensor::full({1, 1, 3, 3}, 1.0f);
    require_close(conv(x, w, none, {1, 1, 1, 1}), {12, 21, 16, 27, 45, 33, 24, 39, 28});
    require_close(conv(x, w, none, {2, 2, 1, 1}), {12, 16, 24, 28});
    // Padding only along H: windows span all three columns.
    require_close(conv(x, w, none, {1, 1, 1, 0}), {21, 45, 39});
  }
  SECTION("1x1 kernel mixes channels; stride 2 picks every other pixel") {
    // Two input channels [1,2,3,4] and [5,6,7,8]; with biases 0, 1, 10:
    // out0 = c0 + c1, out1 = 2*c0 - c1 + 1, out2 = -c1 + 10.
    const Tensor x = iota({1, 2, 2, 2});
    const Tensor w = Tensor::from_vector<float>({1, 1, 2, -1, 0, -1}, {3, 2, 1, 1});
    require_close(conv(x, w, Tensor::from_vector<float>({0, 1, 10}, {3}), {}),
                  {6, 8, 10, 12, -2, -1, 0, 1, 5, 4, 3, 2});
    const Tensor x3 = iota({1, 1, 3, 3});
    require_close(conv(x3, Tensor::full({1, 1, 1, 1}, 2.0f), none, {2, 2, 0, 0}), {2, 6, 14, 18});
  }
  SECTION("5x5 ones kernel on a non-square 5x6 input") {
    // x = 1..30 in 5 rows of 6; the two windows sum columns 0-4 and 1-5.
    const Tensor x = iota({1, 1, 5, 6});
    require_close(conv(x, Tensor::full({1, 1, 5, 5}, 1.0f), none, {}), {375, 400});
    // Padding 2 (LeNet's first layer) keeps the size: the centre output sees all
    // of rows 0-4 and columns 0-4 again.
    const Tensor y = conv(x, Tensor::full({1, 1, 5, 5}, 1.0f), none, {1, 1, 2, 2});
    REQUIRE(y.shape() == Shape{1, 1, 5, 6});
    CHECK(y.data<float>()[2 * 6 + 2] == 375.0f);
    // Corner (0,0) sees rows 0-2, columns 0-2: 1+2+3+7+8+9+13+14+15.
    CHECK(y.data<float>()[0] == 72.0f);
  }
}

TEST_CASE("conv2d kernels match the naive reference in both oneDNN layouts", "[conv]") {
  struct Case {
    Shape x, w;
    Conv2dParams p;
    bool bias;
  };
  const std::vector<Case> cases = {
      {{3, 1, 12, 12}, {6, 1, 5, 5}, {1, 1, 2, 2}, true},     // LeNet conv1
      {{2, 6, 10, 10}, {16, 6, 5, 5}, {1, 1, 0, 0}, true},    // LeNet conv2
      {{2, 16, 7, 7}, {16, 16, 3, 3}, {1, 1, 1, 1}, false},   // ResNet 3x3
      {{2, 16, 7, 7}, {32, 16, 3, 3}, {2, 2, 1, 1}, true},    // ResNet downsampling 3x3
      {{2, 16, 7, 7}, {32, 16, 1, 1}, {2, 2, 0, 0}, false},   // ResNet 1x1 shortcut
      {{1, 3, 6, 9}, {4, 3, 3, 2}, {2, 1, 1, 0}, true},       // non-square everything
      // Dilated: taps 2 apart (DeepLab's 3x3), and 3 x 2 apart on a single channel, which
      // Auto would give the own kernels if they dilated.
      {{2, 16, 9, 9}, {16, 16, 3, 3}, {.stride_h = 1, .stride_w = 1, .pad_h = 2, .pad_w = 2,
                                       .dilation_h = 2, .dilation_w = 2}, false},
      {{3, 1, 13, 12}, {4, 1, 3, 3}, {.stride_h = 1, .stride_w = 2, .pad_h = 1, .pad_w = 0,
                                      .dilation_h = 3, .dilation_w = 2}, true},
  };
  const auto layout = GENERATE(ops::cpu::ConvLayout::Plain, ops::cpu::ConvLayout::Blocked,
                               ops::cpu::ConvLayout::Auto);
  LayoutScope scope(layout);
  uint32_t seed = 1;
  for (const Case& c : cases) {
    INFO("x " << shape_str(c.x) << " w " << shape_str(c.w) << " stride " << c.p.stride_h << "x"
              << c.p.stride_w << " pad " << c.p.pad_h << "x" << c.p.pad_w << " dilation " << c.p.dilation_h << "x"
              << c.p.dilation_w << " layout " << static_cast<int>(layout));
    const Tensor x = random_tensor(c.x, seed++);
    const Tensor w = random_tensor(c.w, seed++);
    const Tensor b = c.bias ? random_tensor({c.w[0]}, seed++) : Tensor();
    const Tensor y = conv(x, w, b, c.p);
    require_close(y, testing::conv2d_ref(x, w, b, c.p), 1e-4, 1e-4);

    const Tensor dy = random_tensor(y.shape(), seed++);
    const auto ref = testing::conv2d_backward_ref(x, w, dy, c.p);
    Tensor dx = Tensor::full(x.shape(), 7.0f);  // overwritten, whatever it held
    ops::conv2d_backward_data(dy, w, dx, c.p);
    require_close(dx, ref.dx, 1e-4, 1e-4);

    Tensor dw = Tensor::full(w.shape(), 7.0f);
    Tensor db = c.bias ? Tensor::full({c.w[0]}, 7.0f) : Tensor();
    ops::conv2d_backward_weights(x, dy, dw, db, c.p, /*accumulate=*/false);
    require_close(dw, ref.dw, 1e-4, 1e-4);
    if (c.bias) require_close(db, ref.db, 1e-4, 1e-4);

    // Accumulating adds the same gradient onto what is there (here: itself).
    ops::conv2d_backward_weights(x, dy, dw, db, c.p, /*accumulate=*/true);
    std::vector<double> twice = ref.dw;
    for (double& v : twice) v *= 2;
    require_close(dw, twice, 2e-4, 1e-4);
    if (c.bias) {
      std::vector<double> twice_b = ref.db;
      for (double& v : twice_b) v *= 2;
      require_close(db, twice_b, 2e-4, 1e-4);
    }
  }
}

TEST_CASE("single-channel convolutions take the direct kernels and match the reference",
          "[conv]") {
  // Auto sends one-input-channel, <= 8-output, stride-1 convolutions forward to the
  // direct kernel (Note [Single-channel convolution]) and their weight gradient to the
  // kernels with images in the vector lanes (Note [Images in the vector lanes]): no
  // oneDNN primitive is created for either on AVX-512 cores, and none for the weight
  // gradient on AVX2 cores, where only that rule applies.
  // Shapes cover 1 to 8 output channels and kernels 1 to 7 wide, rows narrower than,
  // equal to and wider than one 16-float tile,
  // padding wider than the kernel, and 1 to 3 threads splitting an odd batch.
  struct Case {
    Shape x, w;
    int pad_h, pad_w;
  };
  const std::vector<Case> cases = {
      {{5, 1, 28, 28}, {6, 1, 5, 5}, 2, 2},  {{3, 1, 9, 16}, {1, 1, 1, 1}, 0, 0},
      {{2, 1, 7, 33}, {8, 1, 3, 7}, 1, 3},   {{1, 1, 4, 4}, {3, 1, 2, 2}, 0, 1},
      {{3, 1, 11, 17}, {5, 1, 6, 4}, 2, 0},  {{2, 1, 3, 3}, {7, 1, 3, 3}, 4, 4},
      {{4, 1, 5, 12}, {2, 1, 5, 6}, 0, 2},   {{1, 1, 1, 1}, {4, 1, 1, 1}, 0, 0},
  };
  const int threads = GENERATE(1, 2, 3);
  const ThreadsScope scope(threads);
  uint32_t seed = 100;
  for (const Case& c : cases) {
    INFO(describe(c.x, c.w, c.pad_h, c.pad_w, threads));
    const Conv2dParams p{1, 1, c.pad_h, c.pad_w};
    const Tensor x = random_tensor(c.x, seed++);
    const Tensor w = random_tensor(c.w, seed++);
    const Tensor b = random_tensor({c.w[0]}, seed++);
    const long created = ops::cpu::conv_primitives_created();
    const Tensor y = conv(x, w, b, p);
    require_close(y, testing::conv2d_ref(x, w, b, p), 1e-4, 1e-4);
    require_close(conv(x, w, Tensor(), p), testing::conv2d_ref(x, w, Tensor(), p), 1e-4, 1e-4);
    if (ops::cpu::cpu_has_avx512()) CHECK(ops::cpu::conv_primitives_created() == created);

    const long before_gradients = ops::cpu::conv_primitives_created();
    check_weight_gradients(x, w, random_tensor(y.shape(), seed++), p);
    if (ops::cpu::cpu_has_avx512() || ops::cpu::cpu_has_x86_64_v3()) {
      CHECK(ops::cpu::conv_primitives_created() == before_gradients);
    }
  }
}

TEST_CASE("gradients of few-channel convolutions run with images in the vector lanes and "
          "match the reference", "[conv]") {
  // Auto computes the input gradient of stride-1 convolutions with 2-8 input and at
  // most 32 output channels with sixteen images per vector, and their weight gradient
  // too for kernels 5-7 wide (Note [Images in the vector lanes]): no oneDNN primitive
  // is created for those (on AVX-512 cores). Batches with a partial last block of
  // sixteen, 2 to 8 input channels, kernels 1 to 7 wide, output passes of near-equal
  // size, padding wider
  // than the kernel's reach (outputs no tap of some inputs touches), 1 to 3 threads.
  struct Case {
    Shape x, w;
    int pad_h, pad_w;
  };
  const std::vector<Case> cases = {
      {{17, 6, 14, 14}, {16, 6, 5, 5}, 0, 0},  // LeNet's second layer, one image past a block
      {{1, 2, 3, 3}, {1, 2, 1, 1}, 0, 0},      {{33, 3, 9, 11}, {5, 3, 3, 7}, 1, 3},
      {{16, 8, 6, 5}, {7, 8, 4, 2}, 2, 0},     {{5, 4, 7, 7}, {32, 4, 3, 5}, 1, 2},
      {{2, 4, 3, 3}, {3, 4, 3, 3}, 3, 3},      {{3, 5, 8, 8}, {7, 5, 6, 6}, 0, 0},
      {{4, 7, 5, 5}, {5, 7, 1, 1}, 0, 0},      {{18, 3, 4, 6}, {2, 3, 2, 5}, 1, 2},
      {{2, 7, 5, 5}, {9, 7, 5, 5}, 4, 4},      {{3, 2, 6, 9}, {4, 2, 3, 4}, 1, 1},
  };
  const int threads = GENERATE(1, 2, 3);
  const ThreadsScope scope(threads);
  uint32_t seed = 200;
  for (const Case& c : cases) {
    INFO(describe(c.x, c.w, c.pad_h, c.pad_w, threads));
    const Conv2dParams p{1, 1, c.pad_h, c.pad_w};
    const Tensor x = random_tensor(c.x, seed++);
    const Tensor w = random_tensor(c.w, seed++);
    const Tensor y = conv(x, w, Tensor(), p);
    const Tensor dy = random_tensor(y.shape(), seed++);
    const long created = ops::cpu::conv_primitives_created();
    Tensor dx = Tensor::full(x.shape(), 7.0f);  // overwritten, whatever it held
    ops::conv2d_backward_data(dy, w, dx, p);
    require_close(dx, testing::conv2d_backward_ref(x, w, dy, p).dx, 1e-4, 1e-4);
    if (ops::cpu::cpu_has_avx512()) CHECK(ops::cpu::conv_primitives_created() == created);
    if (c.w[3] >= 5) {
      check_weight_gradients(x, w, dy, p);
      if (ops::cpu::cpu_has_avx512()) CHECK(ops::cpu::conv_primitives_created() == created);
    }
  }
}

TEST_CASE("3x3 convolutions with many channels run as Winograd F(2x2, 3x3) and match the "
          "reference", "[conv]") {
  // Auto computes forward and backward-data of stride-1, padding-1 3x3 convolutions as
  // Winograd F(2x2, 3x3) where winograd_applies() says so (Note [Winograd convolution]:
  // 32+ channels on maps of 14x14 and more with AVX-512, 128+ channels on maps of 4x4 to
  // 16x16 with AVX2 and FMA only), and then no oneDNN primitive is created for them.
  // The cases below cover both rules; each runs on whichever path this CPU takes, and
  // must match the reference either way. Odd and even map sides (a last tile row or column half outside the
  // map), non-square maps, more output than input channels and the reverse, a partial
  // last block of sixteen images, bias or not, 1 to 3 threads. The kernel handles maps
  // the rule leaves to oneDNN too; those run through it directly: several tile rows per
  // chunk with a last chunk of one, a single row, a single column.
  struct Case {
    Shape x, w;
    bool bias;
  };
  const std::vector<Case> chosen = {
      {{17, 32, 15, 15}, {32, 32, 3, 3}, true},  {{3, 32, 14, 14}, {48, 32, 3, 3}, false},
      {{2, 40, 17, 14}, {32, 40, 3, 3}, true},   {{1, 33, 14, 21}, {35, 33, 3, 3}, false},
      {{17, 128, 4, 4}, {128, 128, 3, 3}, true}, {{3, 130, 7, 5}, {128, 130, 3, 3}, false},
      {{2, 512, 4, 4}, {512, 512, 3, 3}, false},  // ResNet-18's last layers: sums of 4608 products
  };
  const std::vector<Case> direct = {
      {{2, 32, 25, 8}, {32, 32, 3, 3}, true},  // two tile rows per chunk, a last chunk of one
      {{3, 32, 1, 20}, {33, 32, 3, 3}, false},
      {{2, 34, 9, 1}, {32, 34, 3, 3}, true},
      {{18, 32, 5, 6}, {32, 32, 3, 3}, false},
  };
  const int threads = GENERATE(1, 2, 3);
  const ThreadsScope scope(threads);
  const Conv2dParams p{1, 1, 1, 1};
  uint32_t seed = 400;
  for (const Case& c : chosen) {
    INFO(describe(c.x, c.w, 1, 1, threads));
    const Tensor x = random_tensor(c.x, seed++);
    const Tensor w = random_tensor(c.w, seed++);
    const Tensor b = c.bias ? random_tensor({c.w[0]}, seed++) : Tensor();
    const long created = ops::cpu::conv_primitives_created();
    const Tensor y = conv(x, w, b, p);
    require_close(y, testing::conv2d_ref(x, w, b, p), 1e-4, 1e-4);
    const Tensor dy = random_tensor(y.shape(), seed++);
    Tensor dx = Tensor::full(x.shape(), 7.0f);  // overwritten, whatever it held
    ops::conv2d_backward_data(dy, w, dx, p);
    require_close(dx, testing::conv2d_backward_ref(x, w, dy, p).dx, 1e-4, 1e-4);
    const ops::cpu::ConvGeometry g{c.x[0], c.x[1], c.x[2], c.x[3], c.w[0], 3, 3, c.x[2], c.x[3], 1, 1, 1, 1};
    if (ops::cpu::winograd_applies(g)) CHECK(ops::cpu::conv_primitives_created() == created);
    // The weight gradient, with its own rule; the bias gradient is summed beside it.
    const long before_weights = ops::cpu::conv_primitives_created();
    Tensor dw = Tensor::full(c.w, 7.0f);
    Tensor db = c.bias ? Tensor::full({c.w[0]}, 7.0f) : Tensor();
    ops::conv2d_backward_weights(x, dy, dw, db, p, false);
    const testing::ConvGradRef ref = testing::conv2d_backward_ref(x, w, dy, p);
    require_close(dw, ref.dw, 1e-4, 1e-4);
    if (c.bias) require_close(db, ref.db, 1e-4, 1e-4);
    if (ops::cpu::winograd_weights_applies(g)) CHECK(ops::cpu::conv_primitives_created() == before_weights);
  }
  for (const Case& c : direct) {
    INFO(describe(c.x, c.w, 1, 1, threads) << ", through the kernel directly");
    const Tensor x = random_tensor(c.x, seed++);
    const Tensor w = random_tensor(c.w, seed++);
    const Tensor b = c.bias ? random_tensor({c.w[0]}, seed++) : Tensor();
    const ops::cpu::ConvGeometry g{c.x[0], c.x[1], c.x[2], c.x[3], c.w[0], 3, 3, c.x[2], c.x[3], 1, 1, 1, 1};
    Tensor y = Tensor::full({c.x[0], c.w[0], c.x[2], c.x[3]}, 7.0f);
    ops::cpu::winograd_conv_forward(x.data<float>(), w.data<float>(), c.bias ? b.data<float>() : nullptr,
                                    y.data<float>(), g);
    require_close(y, testing::conv2d_ref(x, w, b, p), 1e-4, 1e-4);
    const Tensor dy = random_tensor(y.shape(), seed++);
    Tensor dx = Tensor::full(x.shape(), 7.0f);
    ops::cpu::winograd_conv_backward_data(dy.data<float>(), w.data<float>(), dx.data<float>(), g);
    require_close(dx, testing::conv2d_backward_ref(x, w, dy, p).dx, 1e-4, 1e-4);
  }
}

TEST_CASE("Winograd weight gradients match the reference", "[conv]") {
  // Note [Winograd convolution]: dw = G^T (sum over tiles of (A dy A^T) .* (B^T x B)) G,
  // run through the kernel directly whatever the rule says for this CPU: odd and even
  // map sides (an output-gradient tile half outside the map), several tile rows per
  // chunk with a short last one, a single row or column, a partial last block of
  // sixteen images, more than one block per thread, overwriting and accumulating,
  // 1 to 3 threads.
  struct Case {
    Shape x;
    int64_t o;
  };
  const std::vector<Case> cases = {
      {{17, 32, 15, 15}, 32}, {{3, 32, 14, 14}, 48}, {{2, 40, 17, 14}, 32},
      {{2, 32, 25, 8}, 33},   {{3, 32, 1, 20}, 32},  {{2, 34, 9, 1}, 32},
      {{40, 16, 4, 4}, 24},   {{18, 32, 5, 6}, 32},
  };
  const int threads = GENERATE(1, 2, 3);
  const ThreadsScope scope(threads);
  const Conv2dParams p{1, 1, 1, 1};
  uint32_t seed = 700;
  for (const Case& c : cases) {
    const Shape ws{c.o, c.x[1], 3, 3};
    INFO(describe(c.x, ws, 1, 1, threads));
    const Tensor x = random_tensor(c.x, seed++);
    const Tensor w = random_tensor(ws, seed++);
    const Tensor dy = random_tensor({c.x[0], c.o, c.x[2], c.x[3]}, seed++);
    const ops::cpu::ConvGeometry g{c.x[0], c.x[1], c.x[2], c.x[3], c.o, 3, 3, c.x[2], c.x[3], 1, 1, 1, 1};
    const testing::ConvGradRef ref = testing::conv2d_backward_ref(x, w, dy, p);
    Tensor dw = Tensor::full(ws, 7.0f);  // overwritten, whatever it held
    ops::cpu::winograd_conv_backward_weights(x.data<float>(), dy.data<float>(), dw.data<float>(), false, g);
    require_close(dw, ref.dw, 1e-4, 1e-4);
    ops::cpu::winograd_conv_backward_weights(x.data<float>(), dy.data<float>(), dw.data<float>(), true, g);
    std::vector<double> twice = ref.dw;
    for (double& v : twice) v *= 2.0;
    require_close(dw, twice, 1e-4, 1e-4);
  }
}

TEST_CASE("an image's Winograd result depends on nothing but the image", "[conv]") {
  // Note [Winograd convolution]: not on its lane, the batch size or the thread count,
  // bit for bit (image 0 alone, and first of 17 images, which makes two blocks of
  // sixteen, on 1, 2 and 3 threads).
  const Conv2dParams p{1, 1, 1, 1};
  const Tensor x = random_tensor({17, 64, 14, 14}, 500);
  const Tensor w = random_tensor({64, 64, 3, 3}, 501);
  const Tensor x0 = x.narrow0(0, 1).clone();
  Tensor alone;
  {
    const ThreadsScope scope(1);
    alone = conv(x0, w, Tensor(), p);
  }
  for (int threads : {1, 2, 3}) {
    INFO(threads << " threads");
    const ThreadsScope scope(threads);
    CHECK(conv(x0, w, Tensor(), p).to_vector<float>() == alone.to_vector<float>());
    CHECK(conv(x, w, Tensor(), p).narrow0(0, 1).to_vector<float>() == alone.to_vector<float>());
  }
}

TEST_CASE("the own kernels process every image when OpenMP runs fewer threads than asked", "[conv]") {
  // Inside another parallel region (nesting off) OpenMP runs an inner region on a team
  // of one, however many threads it asks for. The kernels split their work into as
  // many parts as they asked threads for, and the team runs all of them
  // (for_each_part in tensor/cpu/conv_support.h): direct forward, lanes
  // backward-data and backward-weights, Winograd forward and backward-data, each on
  // 40 images (three blocks of sixteen). Only passes that run on the own kernels are
  // called: oneDNN's primitives spin forever in such a region (a backward-weights
  // primitive waits at its own barrier for threads the team does not have).
  struct Case {
    Shape x, w;
    int pad;
    bool forward, data, weights;
  };
  const std::vector<Case> cases = {
      {{40, 1, 12, 12}, {6, 1, 5, 5}, 2, true, false, true},      // direct forward, lanes weights
      {{40, 6, 10, 10}, {16, 6, 5, 5}, 0, false, true, true},     // lanes backward-data and weights
      {{40, 32, 14, 14}, {32, 32, 3, 3}, 1, true, true, false},  // Winograd
  };
  if (!ops::cpu::cpu_has_avx512()) {
    WARN("no AVX-512: these shapes go to oneDNN, which cannot run in such a region; nothing to check");
    return;
  }
  const ThreadsScope scope(4);
  const int levels = omp_get_max_active_levels();
  omp_set_max_active_levels(1);
  uint32_t seed = 600;
  for (const Case& c : cases) {
    INFO(describe(c.x, c.w, c.pad, c.pad, 4) << " inside a parallel region of two threads");
    const Conv2dParams p{1, 1, c.pad, c.pad};
    const Tensor x = random_tensor(c.x, seed++);
    const Tensor w = random_tensor(c.w, seed++);
    const auto ref_y = testing::conv2d_ref(x, w, Tensor(), p);
    const Shape y_shape{c.x[0], c.w[0], ops::conv_out_size(c.x[2], c.w[2], 1, c.pad),
                        ops::conv_out_size(c.x[3], c.w[3], 1, c.pad)};
    const Tensor dy = random_tensor(y_shape, seed++);
    const auto ref = testing::conv2d_backward_ref(x, w, dy, p);
    Tensor y = Tensor::full(y_shape, 7.0f);
    Tensor dx = Tensor::full(x.shape(), 7.0f);
    Tensor dw = Tensor::full(w.shape(), 7.0f);
    Tensor no_bias;
    const long created = ops::cpu::conv_primitives_created();
#pragma omp parallel num_threads(2)
    if (omp_get_thread_num() == 0) {
      if (c.forward) ops::conv2d_forward(x, w, Tensor(), y, p);
      if (c.data) ops::conv2d_backward_data(dy, w, dx, p);
      if (c.weights) ops::conv2d_backward_weights(x, dy, dw, no_bias, p, /*accumulate=*/false);
    }
    CHECK(ops::cpu::conv_primitives_created() == created);
    if (c.forward) require_close(y, ref_y, 1e-4, 1e-4);
    if (c.data) require_close(dx, ref.dx, 1e-4, 1e-4);
    if (c.weights) require_close(dw, ref.dw, 1e-4, 1e-4);
  }
  omp_set_max_active_levels(levels);
}

TEST_CASE("the few-channel kernels' rule bounds the padded map", "[conv]") {
  // Note [Images in the vector lanes]: the per-thread buffers grow with the padded map,
  // so padding that takes it past 48x48 goes to oneDNN.
  auto geometry = [](int64_t pad) {
    const int64_t out = 8 + 2 * pad - 3 + 1;
    return ops::cpu::ConvGeometry{16, 4, 8, 8, 8, 3, 3, out, out, 1, 1, pad, pad};
  };
  CHECK(ops::cpu::lanes_backward_data_applies(geometry(20)) == ops::cpu::cpu_has_avx512());
  CHECK_FALSE(ops::cpu::lanes_backward_data_applies(geometry(21)));
}

TEST_CASE("the few-channel kernels' rules name the instruction sets they were measured on", "[conv]") {
  // Note [Images in the vector lanes]: everything on AVX-512; on AVX2 with FMA only the
  // single-channel weight gradient (LeNet's first layer), which measured faster there.
  const ops::cpu::ConvGeometry first{256, 1, 28, 28, 6, 5, 5, 28, 28, 1, 1, 2, 2};
  const ops::cpu::ConvGeometry second{256, 6, 14, 14, 16, 5, 5, 10, 10, 1, 1, 0, 0};
  const bool avx512 = ops::cpu::cpu_has_avx512();
  CHECK(ops::cpu::lanes_backward_weights_applies(first) == (avx512 || ops::cpu::cpu_has_x86_64_v3()));
  CHECK(ops::cpu::lanes_backward_weights_applies(second) == avx512);
  CHECK(ops::cpu::lanes_backward_data_applies(second) == avx512);
}

TEST_CASE("the Winograd rule names the instruction sets it was measured on", "[conv]") {
  // Note [Winograd convolution]: with AVX-512, 32+ channels on maps of at least 14x14;
  // with AVX2 and FMA only, 128+ channels on maps of 4x4 to 16x16, for weight gradients
  // too; otherwise never.
  // ResNet-18's stride-1 3x3 layers on 28x28 images, then the edges of both rules.
  auto g = [](int64_t channels, int64_t h, int64_t w) {
    return ops::cpu::ConvGeometry{64, channels, h, w, channels, 3, 3, h, w, 1, 1, 1, 1};
  };
  const bool avx512 = ops::cpu::cpu_has_avx512();
  const bool avx2 = !avx512 && ops::cpu::cpu_has_x86_64_v3();
  CHECK(ops::cpu::winograd_applies(g(64, 28, 28)) == avx512);
  CHECK(ops::cpu::winograd_applies(g(128, 14, 14)) == (avx512 || avx2));
  CHECK(ops::cpu::winograd_applies(g(256, 7, 7)) == avx2);
  CHECK(ops::cpu::winograd_applies(g(512, 4, 4)) == avx2);
  CHECK(ops::cpu::winograd_applies(g(32, 14, 14)) == avx512);
  CHECK_FALSE(ops::cpu::winograd_applies(g(31, 28, 28)));
  CHECK(ops::cpu::winograd_applies(g(128, 16, 16)) == (avx512 || avx2));
  CHECK(ops::cpu::winograd_applies(g(128, 16, 17)) == avx512);
  CHECK_FALSE(ops::cpu::winograd_applies(g(127, 8, 8)));
  CHECK_FALSE(ops::cpu::winograd_applies(g(128, 3, 8)));
  // Weight gradients: the AVX2 rule, on AVX2 CPUs only (not measured with AVX-512).
  CHECK_FALSE(ops::cpu::winograd_weights_applies(g(64, 28, 28)));
  CHECK(ops::cpu::winograd_weights_applies(g(128, 14, 14)) == avx2);
  CHECK(ops::cpu::winograd_weights_applies(g(512, 4, 4)) == avx2);
  CHECK_FALSE(ops::cpu::winograd_weights_applies(g(128, 16, 17)));
  CHECK_FALSE(ops::cpu::winograd_weights_applies(g(127, 8, 8)));
  CHECK_FALSE(ops::cpu::winograd_weights_applies({64, 128, 14, 14, 128, 3, 3, 7, 7, 2, 2, 1, 1}));
  // Only stride 1, padding 1, 3x3.
  CHECK_FALSE(ops::cpu::winograd_applies({64, 128, 14, 14, 128, 3, 3, 7, 7, 2, 2, 1, 1}));
  CHECK_FALSE(ops::cpu::winograd_applies({64, 128, 14, 14, 128, 3, 3, 12, 12, 1, 1, 0, 0}));
  CHECK_FALSE(ops::cpu::winograd_applies({64, 128, 14, 14, 128, 5, 5, 14, 14, 1, 1, 2, 2}));
}

TEST_CASE("weight gradients over few output positions are one GEMM and match the reference",
          "[conv]") {
  // Auto computes stride-1 weight gradients with at most 16 output positions per image
  // as one sgemm (Note [Weight gradients as a GEMM]): no oneDNN primitive is created for
  // them. Padding on both sides, non-square kernels and maps, one position per image,
  // bias or not, 1 and 2 threads.
  struct Case {
    Shape x, w;
    int pad_h, pad_w;
  };
  const std::vector<Case> cases = {
      {{3, 8, 4, 4}, {5, 8, 3, 3}, 1, 1},  // ResNet-18's last stage, scaled down
      {{2, 4, 2, 3}, {3, 4, 2, 2}, 0, 0},  // 1 x 2 positions
      {{1, 2, 1, 1}, {4, 2, 1, 1}, 0, 0},  // one position
      {{2, 3, 3, 5}, {2, 3, 3, 1}, 0, 1},  // 1 x 7 positions, padded columns only
      {{4, 5, 2, 2}, {6, 5, 3, 3}, 1, 1},  // kernel larger than the map
  };
  const int threads = GENERATE(1, 2);
  const ThreadsScope scope(threads);
  uint32_t seed = 300;
  for (const Case& c : cases) {
    const Conv2dParams p{1, 1, c.pad_h, c.pad_w};
    INFO(describe(c.x, c.w, c.pad_h, c.pad_w, threads));
    const Tensor x = random_tensor(c.x, seed++);
    const Tensor w = random_tensor(c.w, seed++);
    const Tensor y = conv(x, w, Tensor(), p);
    REQUIRE(y.size(2) * y.size(3) <= 16);
    const long created = ops::cpu::conv_primitives_created();
    check_weight_gradients(x, w, random_tensor(y.shape(), seed++), p);
    CHECK(ops::cpu::conv_primitives_created() == created);
  }
}

TEST_CASE("GEMM weight gradients built a block of input channels at a time match one block",
          "[conv]") {
  // Note [Weight gradients as a GEMM]: a rows budget smaller than the patches of the whole
  // input splits the channels into blocks, each writing its own columns of dw. The
  // budgets give one channel per block, 2 channels (3 blocks, the last one short) and
  // every channel at once; accumulation adds onto dw and db in every case.
  const Shape xs{3, 5, 4, 4}, ws{6, 5, 3, 3};
  const Conv2dParams p{1, 1, 1, 1};
  const ops::cpu::ConvGeometry g{3, 5, 4, 4, 6, 3, 3, 4, 4, 1, 1, 1, 1};
  REQUIRE(ops::cpu::gemm_weights_applies(g));
  const Tensor x = random_tensor(xs, 401);
  const Tensor dy = random_tensor({3, 6, 4, 4}, 402);
  const auto ref = testing::conv2d_backward_ref(x, random_tensor(ws, 403), dy, p);
  const size_t channel_bytes = 3 * 16 * 9 * sizeof(float);  // n * positions * kh * kw
  for (const size_t budget : {size_t{1}, 2 * channel_bytes + 7, size_t{1} << 30}) {
    INFO("rows budget " << budget << " bytes");
    Tensor dw = Tensor::full(ws, 7.0f), db = Tensor::full({6}, 7.0f);
    ops::cpu::gemm_conv_backward_weights(x.data<float>(), dy.data<float>(), dw.data<float>(),
                                         db.data<float>(), /*accumulate=*/false, g, budget);
    require_close(dw, ref.dw, 1e-4, 1e-4);
    require_close(db, ref.db, 1e-4, 1e-4);
    ops::cpu::gemm_conv_backward_weights(x.data<float>(), dy.data<float>(), dw.data<float>(),
                                         db.data<float>(), /*accumulate=*/true, g, budget);
    std::vector<double> dw2 = ref.dw, db2 = ref.db;
    for (double& v : dw2) v *= 2.0;
    for (double& v : db2) v *= 2.0;
    require_close(dw, dw2, 1e-4, 1e-4);
    require_close(db, db2, 1e-4, 1e-4);
  }
}

TEST_CASE("conv2d backward ops are the gradients of the forward op", "[conv]") {
  // L = sum(conv(x, w) + b) * r) is linear in x, w and b, so central differences are
  // exact up to rounding even with a large step.
  const Conv2dParams p = GENERATE(Conv2dParams{1, 1, 0, 0}, Conv2dParams{2, 2, 1, 1},
                                  Conv2dParams{2, 1, 0, 1});
  const int k = GENERATE(1, 3);
  Tensor x = random_tensor({2, 3, 5, 6}, 11);
  Tensor w = random_tensor({4, 3, k, k}, 12);
  Tensor b = random_tensor({4}, 13);
  const Tensor r = random_tensor(conv(x, w, b, p).shape(), 14);
  auto loss = [&] { return testing::dot(conv(x, w, b, p), r); };

  Tensor dx = Tensor::empty(x.shape());
  ops::conv2d_backward_data(r, w, dx, p);
  require_close(dx, testing::finite_difference(x, loss, 0.5f), 1e-3, 1e-3);

  Tensor dw = Tensor::empty(w.shape());
  Tensor db = Tensor::empty(b.shape());
  ops::conv2d_backward_weights(x, r, dw, db, p, false);
  require_close(dw, testing::finite_difference(w, loss, 0.5f), 1e-3, 1e-3);
  require_close(db, testing::finite_difference(b, loss, 0.5f), 1e-3, 1e-3);
}

TEST_CASE("conv2d steady state creates no primitives and handles empty batches", "[conv]") {
  const Conv2dParams p{1, 1, 1, 1};
  const Tensor x = random_tensor({4, 8, 9, 9}, 21);
  const Tensor w = random_tensor({8, 8, 3, 3}, 22);
  const Tensor b = random_tensor({8}, 23);
  Tensor y = Tensor::empty({4, 8, 9, 9});
  Tensor dx = Tensor::empty(x.shape()), dw = Tensor::empty(w.shape()), db = Tensor::empty({8});
  auto step = [&] {
    ops::conv2d_forward(x, w, b, y, p);
    ops::conv2d_backward_data(y, w, dx, p);
    ops::conv2d_backward_weights(x, y, dw, db, p, true);
  };
  step();
  const long created = ops::cpu::conv_primitives_created();
  const uint64_t allocs = host_allocator_stats().system_allocs;
  for (int i = 0; i < 3; ++i) step();
  CHECK(ops::cpu::conv_primitives_created() == created);
  CHECK(host_allocator_stats().system_allocs == allocs);

  // N == 0: nothing to compute; an overwritten gradient becomes zero.
  const Tensor x0 = Tensor::empty({0, 8, 9, 9});
  Tensor y0 = Tensor::empty({0, 8, 9, 9});
  ops::conv2d_forward(x0, w, b, y0, p);
  ops::conv2d_backward_weights(x0, y0, dw, db, p, false);
  for (float v : dw.to_vector<float>()) REQUIRE(v == 0.0f);
  for (float v : db.to_vector<float>()) REQUIRE(v == 0.0f);

  // C == 0: an empty sum, so y is the bias (or zero), as for linear with no inputs.
  const Tensor xc0 = Tensor::empty({2, 0, 5, 5});
  const Tensor wc0 = Tensor::empty({3, 0, 3, 3});
  const Tensor b3 = Tensor::from_vector<float>({1.5f, -2.0f, 0.25f}, {3});
  Tensor yc0 = Tensor::full({2, 3, 3, 3}, 7.0f);
  ops::conv2d_forward(xc0, wc0, b3, yc0, {});
  const auto got = yc0.to_vector<float>();
  for (size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == b3.data<float>()[(i / 9) % 3]);
  ops::conv2d_forward(xc0, wc0, Tensor(), yc0, {});
  for (float v : yc0.to_vector<float>()) REQUIRE(v == 0.0f);
}

TEST_CASE("conv2d rejects mismatched shapes naming the op", "[conv]") {
  const Tensor x = random_tensor({2, 3, 8, 8}, 31);
  const Tensor w = random_tensor({4, 3, 3, 3}, 32);
  Tensor y = Tensor::empty({2, 4, 6, 6});
  Tensor bad_y = Tensor::empty({2, 4, 8, 8});
  CHECK_THROWS_WITH(ops::conv2d_forward(x, w, Tensor(), bad_y, {}),
                    Catch::Contains("conv2d_forward") && Catch::Contains("[2, 4, 6, 6]") &&
                        Catch::Contains("[2, 4, 8, 8]"));
  const Tensor w_bad_c = random_tensor({4, 2, 3, 3}, 33);
  CHECK_THROWS_AS(ops::conv2d_forward(x, w_bad_c, Tensor(), y, {}), InternalError);
  CHECK_THROWS_AS(ops::conv2d_forward(x, w, Tensor::empty({3}), y, {}), InternalError);
  Tensor dx_bad = Tensor::empty({2, 3, 9, 9});
  CHECK_THROWS_AS(ops::conv2d_backward_data(y, w, dx_bad, {}), InternalError);
  Tensor dw_bad = Tensor::empty({4, 3, 2, 2});
  Tensor db;
  CHECK_THROWS_AS(ops::conv2d_backward_weights(x, y, dw_bad, db, {}, false), InternalError);
}
