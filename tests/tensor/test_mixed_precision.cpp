// Note [Reduced-precision compute] on the CPU: the rounding itself, checked on values
// whose rounding is known, then convolutions and linear layers with compute = bfloat16
// against the float32 kernels applied to rounded inputs, and the loss-scaling check.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "tensor/cpu/conv_support.h"
#include "tensor/cpu/conv_layout.h"
#include "tensor/ops.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::ops::Conv2dParams;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;

namespace {

std::vector<float> rounded(std::vector<float> values, DType to) {
  Tensor t = Tensor::from_vector<float>(values, {static_cast<int64_t>(values.size())});
  ops::round_to_dtype(t, to, t);
  const float* p = t.data<float>();
  return {p, p + t.numel()};
}

Tensor rounded(const Tensor& t, DType to) {
  Tensor r = Tensor::empty(t.shape());
  ops::round_to_dtype(t, to, r);
  return r;
}


bool bf16_convolutions() {
  if (ops::compute_dtype_supported(DType::BFloat16, Device::cpu())) return true;
  WARN("skipped: oneDNN has no bfloat16 convolutions on this CPU");
  return false;
}

constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

TEST_CASE("round_to_dtype rounds to nearest even, keeps NaN and overflows to infinity", "[mixed]") {
  const float one = 1.0f;
  // bfloat16 keeps 7 mantissa bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (odd) -> 1;
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even) -> 1 + 2^-6.
  const auto b = rounded({one, one + std::ldexp(1.0f, -8), one + 3 * std::ldexp(1.0f, -8),
                          one + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20), -2.5f,
                          std::numeric_limits<float>::max(), kInf, std::nanf("")},
                         DType::BFloat16);
  CHECK(b[0] == one);
  CHECK(b[1] == one);
  CHECK(b[2] == one + std::ldexp(1.0f, -6));
  CHECK(b[3] == one + std::ldexp(1.0f, -7));  // above the halfway point
  CHECK(b[4] == -2.5f);
  CHECK(b[5] == kInf);
  CHECK(b[6] == kInf);
  CHECK(std::isnan(b[7]));
  // float16: 10 mantissa bits, largest finite 65504, smallest subnormal 2^-24.
  const auto h = rounded({one + std::ldexp(1.0f, -11), 65504.0f, 65520.0f, std::ldexp(1.0f, -24),
                          std::ldexp(1.0f, -26), 0.1f},
                         DType::Float16);
  CHECK(h[0] == one);
  CHECK(h[1] == 65504.0f);
  CHECK(h[2] == kInf);  // halfway to 65536, which is past the range: to even = infinity
  CHECK(h[3] == std::ldexp(1.0f, -24));
  CHECK(h[4] == 0.0f);
  CHECK(h[5] == 0.0999755859375f);
}

TEST_CASE("bfloat16 convolutions equal float32 ones on rounded operands", "[mixed]") {
  if (!bf16_convolutions()) return;
  struct Case {
    int64_t n, c, h, o, k;
    int stride, pad;
  };
  for (const Case& c : {Case{2, 3, 9, 8, 3, 1, 1}, Case{3, 16, 7, 32, 3, 2, 1}, Case{2, 8, 6, 16, 1, 1, 0},
                        Case{2, 1, 12, 6, 5, 1, 0}}) {
    INFO("n " << c.n << " c " << c.c << " h " << c.h << " o " << c.o << " k " << c.k);
    const Tensor x = random_tensor({c.n, c.c, c.h, c.h}, 1);
    const Tensor w = random_tensor({c.o, c.c, c.k, c.k}, 2);
    const Tensor b = random_tensor({c.o}, 3);
    Conv2dParams p32{c.stride, c.stride, c.pad, c.pad};
    Conv2dParams p16 = p32;
    p16.compute = DType::BFloat16;
    const int64_t oh = ops::conv_out_size(c.h, c.k, c.stride, c.pad);
    const Tensor dy = random_tensor({c.n, c.o, oh, oh}, 4);
    const Tensor xr = rounded(x, DType::BFloat16), wr = rounded(w, DType::BFloat16),
                 dyr = rounded(dy, DType::BFloat16);

    // Forward: the products are exact in float32, only the order of the sums differs.
    Tensor y16 = Tensor::empty({c.n, c.o, oh, oh}), y_ref = Tensor::empty({c.n, c.o, oh, oh}),
           y32 = Tensor::empty({c.n, c.o, oh, oh});
    ops::conv2d_forward(x, w, b, y16, p16);
    ops::conv2d_forward(xr, wr, b, y_ref, p32);
    ops::conv2d_forward(x, w, b, y32, p32);
    require_close(y16, y_ref, 1e-5, 1e-5);
    // ... and not what float32 computes on the unrounded operands (bf16 moved them by up
    // to 2^-8 relative each, so the sums move by about 1e-3).
    CHECK(testing::max_abs_gap(y16, y32) > 1e-4);

    Tensor dx16 = Tensor::empty(x.shape()), dx_ref = Tensor::empty(x.shape());
    ops::conv2d_backward_data(dy, w, dx16, p16);
    ops::conv2d_backward_data(dyr, wr, dx_ref, p32);
    require_close(dx16, dx_ref, 1e-5, 1e-5);

    // Weights: accumulated onto existing values; the bias gradient sums the float32 dy.
    Tensor dw16 = random_tensor(w.shape(), 5), dw_ref = dw16.clone();
    Tensor db16 = random_tensor({c.o}, 6), db_ref = db16.clone();
    Tensor db_unused = random_tensor({c.o}, 6);
    ops::conv2d_backward_weights(x, dy, dw16, db16, p16, /*accumulate=*/true);
    ops::conv2d_backward_weights(xr, dyr, dw_ref, db_unused, p32, /*accumulate=*/true);
    Tensor dw_ignored = Tensor::zeros(w.shape());
    ops::conv2d_backward_weights(x, dy, dw_ignored, db_ref, p32, /*accumulate=*/true);
    require_close(dw16, dw_ref, 1e-4, 1e-5);
    require_close(db16, db_ref, 1e-5, 1e-5);
  }
}

TEST_CASE("bfloat16 linear layers equal float32 ones on rounded operands", "[mixed]") {
  const Tensor x = random_tensor({5, 7}, 11), w = random_tensor({3, 7}, 12), b = random_tensor({3}, 13);
  const Tensor dy = random_tensor({5, 3}, 14);
  const DType bf16 = DType::BFloat16;
  Tensor y16 = Tensor::empty({5, 3}), y_ref = Tensor::empty({5, 3});
  ops::linear_forward(x, w, b, y16, bf16);
  ops::linear_forward(rounded(x, bf16), rounded(w, bf16), b, y_ref);
  require_close(y16, y_ref, 1e-6, 1e-6);
  Tensor dx16 = Tensor::empty({5, 7}), dw16 = Tensor::zeros({3, 7}), db16 = Tensor::zeros({3});
  Tensor dx_ref = Tensor::empty({5, 7}), dw_ref = Tensor::zeros({3, 7}), db_unused = Tensor::zeros({3});
  Tensor db_ref = Tensor::zeros({3}), dx_unused = Tensor(), dw_unused = Tensor::zeros({3, 7});
  ops::linear_backward(x, w, dy, dx16, dw16, db16, /*accumulate=*/true, bf16);
  ops::linear_backward(rounded(x, bf16), rounded(w, bf16), rounded(dy, bf16), dx_ref, dw_ref, db_unused, true);
  ops::linear_backward(x, w, dy, dx_unused, dw_unused, db_ref, true);
  require_close(dx16, dx_ref, 1e-6, 1e-6);
  require_close(dw16, dw_ref, 1e-6, 1e-6);
  require_close(db16, db_ref, 1e-6, 1e-6);  // the float32 dy
}

TEST_CASE("non_finite_check_and_unscale scales every gradient and finds inf and NaN anywhere", "[mixed]") {
  const auto make = [](std::vector<float> v) {
    return Tensor::from_vector<float>(v, {static_cast<int64_t>(v.size())});
  };
  Tensor a = make({2.0f, -4.0f, 3e38f}), b = make({8.0f, 0.0f});
  CHECK_FALSE(ops::non_finite_check_and_unscale({&a, &b}, 0.5f));
  CHECK(a.to_vector<float>() == std::vector<float>{1.0f, -2.0f, 1.5e38f});
  CHECK(b.to_vector<float>() == std::vector<float>{4.0f, 0.0f});
  for (const float bad : {kInf, -kInf, std::nanf("")}) {
    Tensor c = make({1.0f, 1.0f}), d = make({1.0f, bad, 1.0f});
    CHECK(ops::non_finite_check_and_unscale({&c, &d}, 0.25f));
    CHECK(c.to_vector<float>()[0] == 0.25f);
  }
  // A large tensor, split over threads, with one infinity near its end.
  Tensor big = Tensor::zeros({300000});
  big.data<float>()[299990] = kInf;
  CHECK(ops::non_finite_check_and_unscale({&big}, 1.0f));
}

TEST_CASE("under bfloat16 the own few-channel kernels run on rounded operands, creating no primitive",
          "[mixed]") {
  // Note [Own kernels under --amp] in conv.cpp: LeNet's shapes (1 -> 6 and 6 -> 16, 5x5)
  // take the float32 direct (forward of one input channel) and lanes (gradients) kernels
  // on operands rounded to bfloat16, so the result is bit for bit the float32 kernel's on
  // the rounded operands; the forward of 6 channels is oneDNN's bf16 primitive.
  if (!mtrain::ops::cpu::cpu_has_avx512()) {
    WARN("skipped: the own kernels need AVX-512");
    return;
  }
  const DType bf16 = DType::BFloat16;
  struct Case {
    int64_t c, h, o;
  };
  for (const Case& c : {Case{1, 28, 6}, Case{6, 14, 16}}) {
    INFO("c " << c.c << " o " << c.o);
    const int64_t n = 16, oh = c.h - 4;
    const Tensor x = random_tensor({n, c.c, c.h, c.h}, 21), w = random_tensor({c.o, c.c, 5, 5}, 22);
    const Tensor b = random_tensor({c.o}, 23), dy = random_tensor({n, c.o, oh, oh}, 24);
    const Tensor xr = rounded(x, bf16), wr = rounded(w, bf16), dyr = rounded(dy, bf16);
    Conv2dParams p32{1, 1, 0, 0};
    Conv2dParams p16 = p32;
    p16.compute = bf16;
    const long before_forward = ops::cpu::conv_primitives_created();
    Tensor y16 = Tensor::empty({n, c.o, oh, oh}), y_ref = Tensor::empty({n, c.o, oh, oh});
    ops::conv2d_forward(x, w, b, y16, p16);
    if (c.c == 1) CHECK(ops::cpu::conv_primitives_created() == before_forward);
    const long primitives = ops::cpu::conv_primitives_created();
    Tensor dw16 = Tensor::zeros(w.shape()), db16 = Tensor::zeros({c.o});
    ops::conv2d_backward_weights(x, dy, dw16, db16, p16, /*accumulate=*/true);
    Tensor dx16 = Tensor::empty(x.shape());
    if (c.c > 1) ops::conv2d_backward_data(dy, w, dx16, p16);  // a first layer skips it
    CHECK(ops::cpu::conv_primitives_created() == primitives);
    ops::conv2d_forward(xr, wr, b, y_ref, p32);
    if (c.c == 1) {
      CHECK(testing::max_abs_gap(y16, y_ref) == 0.0);
    } else {
      require_close(y16, y_ref, 1e-5, 1e-5);
    }
    Tensor dw_ref = Tensor::zeros(w.shape()), db_ref = Tensor::zeros({c.o}), db_unused = Tensor::zeros({c.o});
    ops::conv2d_backward_weights(xr, dyr, dw_ref, db_unused, p32, true);
    CHECK(testing::max_abs_gap(dw16, dw_ref) == 0.0);
    Tensor dw_unused = Tensor::zeros(w.shape());
    ops::conv2d_backward_weights(x, dy, dw_unused, db_ref, p32, true);
    // From the float32 dy, summed in another order than the lanes kernel sums 9216 terms.
    require_close(db16, db_ref, 1e-3, 1e-5);
    if (c.c > 1) {
      Tensor dx_ref = Tensor::empty(x.shape());
      ops::conv2d_backward_data(dyr, wr, dx_ref, p32);
      CHECK(testing::max_abs_gap(dx16, dx_ref) == 0.0);
    }
  }
}

TEST_CASE("convert rounds float32 to 16-bit storage as round_to_dtype does, and widens exactly", "[mixed]") {
  const Tensor x = random_tensor({1000}, 31, -70000.0f, 70000.0f);
  for (const DType t : {DType::BFloat16, DType::Float16}) {
    INFO(dtype_name(t));
    Tensor narrow = Tensor::empty({1000}, t);
    ops::convert(x, narrow);
    Tensor back = Tensor::empty({1000});
    ops::convert(narrow, back);
    // Widening is exact, so narrowing then widening is the rounding itself (float16
    // overflows to infinity beyond 65520, as round_to_dtype).
    const Tensor r = rounded(x, t);
    CHECK(std::memcmp(back.raw_data(), r.raw_data(), r.nbytes()) == 0);
  }
  Tensor wrong = Tensor::empty({1000}, DType::Int32);
  CHECK_THROWS_AS(ops::convert(x, wrong), mtrain::InternalError);
}

// Note [Kernel dispatch]: these checks run before a device is chosen.
TEST_CASE("convert and non_finite_check_and_unscale check their arguments before dispatching",
          "[mixed]") {
  const Tensor x = Tensor::zeros({4});
  Tensor shorter = Tensor::empty({3}, DType::BFloat16), undefined;
  CHECK_THROWS_WITH(ops::convert(x, shorter),
                    Catch::Contains("convert: expected two tensors of equal size on one device"));
  CHECK_THROWS_WITH(ops::convert(x, undefined), Catch::Contains("found Tensor[float32, [4], cpu] and "
                                                                "undefined"));
  CHECK_FALSE(ops::non_finite_check_and_unscale({}, 0.5f));
  CHECK_THROWS_WITH(ops::non_finite_check_and_unscale({&undefined}, 0.5f),
                    Catch::Contains("non_finite_check_and_unscale: gradient 0 is undefined"));
  CHECK_THROWS_WITH(ops::non_finite_check_and_unscale({nullptr}, 0.5f),
                    Catch::Contains("gradient 0 is undefined"));
}

// Note [Ops on 16-bit storage] in tensor/ops.cpp: on the CPU every op given 16-bit tensors
// computes what its float32 kernel computes on their widened values, each 16-bit output
// rounded once; a listed op (the GPU's 16-bit kernels) refuses mixed activation types here
// too, so a layer that mixes them fails in CI rather than on a GPU.
namespace {

Tensor stored(const Tensor& f32, DType t) {
  Tensor s = Tensor::empty(f32.shape(), t);
  ops::convert(f32, s);
  return s;
}

Tensor widened(const Tensor& t16) {
  Tensor w = Tensor::empty(t16.shape());
  ops::convert(t16, w);
  return w;
}

// Whether 16-bit `actual` holds float32 `expected` rounded to its type.
bool holds_rounded(const Tensor& actual, const Tensor& expected) {
  const Tensor r = widened(stored(expected, actual.dtype()));
  const Tensor a = widened(actual);
  return a.shape() == r.shape() && std::memcmp(a.raw_data(), r.raw_data(), r.nbytes()) == 0;
}

}  // namespace

TEST_CASE("ops on 16-bit activations compute in float32 and round each output once", "[mixed][storage16]") {
  const DType t = GENERATE(DType::BFloat16, DType::Float16);
  INFO(dtype_name(t));
  const Tensor x = stored(random_tensor({2, 3, 6, 6}, 41), t), r = stored(random_tensor({2, 3, 6, 6}, 42), t);
  const Tensor wx = widened(x), wr = widened(r);

  SECTION("elementwise, in place included") {
    Tensor y = Tensor::empty(x.shape(), t), y32 = Tensor::empty(x.shape());
    ops::relu_forward(x, y);
    ops::relu_forward(wx, y32);
    CHECK(holds_rounded(y, y32));
    Tensor out = r.clone(), out32 = wr.clone();
    ops::add_(out, x, 0.5f);  // reads what it writes
    ops::add_(out32, wx, 0.5f);
    CHECK(holds_rounded(out, out32));
  }
  SECTION("a convolution with float32 weights and compute") {
    const Tensor w = random_tensor({4, 3, 3, 3}, 43), b = random_tensor({4}, 44);
    const Conv2dParams p{1, 1, 1, 1};
    Tensor y = Tensor::empty({2, 4, 6, 6}, t), y32 = Tensor::empty({2, 4, 6, 6});
    ops::conv2d_forward(x, w, b, y, p);
    ops::conv2d_forward(wx, w, b, y32, p);
    CHECK(holds_rounded(y, y32));
    Tensor dw = Tensor::empty(w.shape()), dw32 = Tensor::empty(w.shape()), no_bias;
    ops::conv2d_backward_weights(x, stored(y32, t), dw, no_bias, p, /*accumulate=*/false);
    ops::conv2d_backward_weights(wx, widened(stored(y32, t)), dw32, no_bias, p, false);
    CHECK(dw.dtype() == DType::Float32);
    CHECK(testing::max_abs_gap(dw, dw32) == 0.0);
  }
  SECTION("batch norm: float32 statistics from 16-bit inputs, the fused apply rounded once") {
    Tensor mean = Tensor::empty({3}), var = Tensor::empty({3}), mean32 = Tensor::empty({3}), var32 = Tensor::empty({3});
    ops::batchnorm_stats(x, mean, var);
    ops::batchnorm_stats(wx, mean32, var32);
    CHECK(testing::max_abs_gap(mean, mean32) == 0.0);
    CHECK(testing::max_abs_gap(var, var32) == 0.0);
    const Tensor invstd = random_tensor({3}, 45, 0.5f, 2.0f), gamma = random_tensor({3}, 46), beta = random_tensor({3}, 47);
    Tensor y = Tensor::empty(x.shape(), t), y32 = Tensor::empty(x.shape());
    ops::batchnorm_apply_relu(x, mean, invstd, gamma, beta, r, y);
    ops::batchnorm_apply_relu(wx, mean, invstd, gamma, beta, wr, y32);
    CHECK(holds_rounded(y, y32));
  }
  SECTION("an op without 16-bit kernels anywhere: max pooling, its indices untouched") {
    const ops::Pool2dParams p;
    Tensor y = Tensor::empty({2, 3, 3, 3}, t), y32 = Tensor::empty({2, 3, 3, 3});
    Tensor idx = Tensor::empty({2, 3, 3, 3}, DType::Int32), idx32 = Tensor::empty({2, 3, 3, 3}, DType::Int32);
    ops::maxpool2d_forward(x, y, idx, p);
    ops::maxpool2d_forward(wx, y32, idx32, p);
    CHECK(holds_rounded(y, y32));
    CHECK(std::memcmp(idx.raw_data(), idx32.raw_data(), idx.nbytes()) == 0);
  }
  SECTION("mixed activation types in a GPU-listed op are refused on the CPU too") {
    Tensor out = Tensor::empty(x.shape(), t);
    CHECK_THROWS_WITH(ops::add(x, wr, out), Catch::Contains("add: the activations must share one storage type"));
    Tensor y32 = Tensor::empty(x.shape());
    CHECK_THROWS_AS(ops::relu_forward(x, y32), mtrain::InternalError);
  }
}
