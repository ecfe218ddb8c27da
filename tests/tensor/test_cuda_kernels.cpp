// gpu: mtrain's own CUDA kernels (elementwise, pooling, batch norm, loss, SGD) against
// the CPU kernels on the same random inputs. Skips the whole binary without a GPU.
//
// Tolerances. Where the GPU kernel performs the CPU kernel's float operations in the
// same order with the same roundings (Note [Unfused float arithmetic] in
// tensor/cuda/launch.cuh), results must be identical bit for bit: a kernel that reads a
// wrong element, or rounds differently, fails. Reductions that sum in another order get
// a tolerance stated next to them.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/error.h"
#include "tensor/cuda_ops.h"
#include "tensor/cuda_devices.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tests/support/skip.h"
#include "tests/tensor/numerics_scope.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::ops::Pool2dParams;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;
using mtrain::testing::require_same_bits;

#ifdef MTRAIN_HAVE_CUDA

namespace {

void require_gpu() {
  if (cuda_info().device_count == 0) testing::skip_test_binary(cuda_summary().c_str());
}

const Device kGpu = Device::cuda(0);

Tensor on_gpu(const Tensor& t) { return t.to(kGpu); }
Tensor on_cpu(const Tensor& t) { return t.to(Device::cpu()); }

// GPU result within atol + rtol * |cpu| of the CPU result, elementwise.
void require_near(const Tensor& gpu_result, const Tensor& cpu_result, double atol, double rtol) {
  require_close(on_cpu(gpu_result), cpu_result, atol, rtol);
}

// Random values rounded to multiples of 0.25 in [-1, 1]: many exact ties, to check that
// both kernels pick the same maximum. Adding +0 turns the -0 that rounding gives into +0:
// the CPU's tiled average pool starts its sums from the first element and the general
// one from +0, which differ in the sign of an all-zero window's result.
Tensor tied_tensor(const Shape& shape, uint32_t seed) {
  Tensor t = random_tensor(shape, seed);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = std::round(p[i] * 4.0f) / 4.0f + 0.0f;
  return t;
}

Shape pooled_shape(const Shape& x, const Pool2dParams& p) {
  return {x[0], x[1], ops::pool_out_size(x[2], p.kernel_h, p.stride_h, p.pad_h, p.ceil_mode),
          ops::pool_out_size(x[3], p.kernel_w, p.stride_w, p.pad_w, p.ceil_mode)};
}

}  // namespace

// ---- elementwise ------------------------------------------------------------------------

TEST_CASE("GPU elementwise kernels equal the CPU's", "[cuda][elementwise]") {
  require_gpu();
  // 0 and odd sizes exercise the scalar tail after the float4 body; the offset view (one
  // float in) is never 16-byte aligned, which forces the scalar path throughout.
  const int64_t n = GENERATE(0, 1, 3, 1027, (1 << 20) + 5);
  const bool offset_view = GENERATE(false, true);
  CAPTURE(n, offset_view);
  auto make = [&](uint32_t seed, float lo = -2.0f, float hi = 2.0f) {
    const Tensor host = random_tensor({n + 1}, seed, lo, hi);
    return offset_view ? host.flat_view(1, {n}) : host.flat_view(0, {n});
  };
  const Tensor a = make(1), b = make(2), y_sig = make(3, 0.0f, 1.0f);
  // The GPU copies of views keep the offset: copy whole buffers, then view the same way.
  auto gpu_view = [&](const Tensor& host_view) {
    const Tensor whole = on_gpu(random_tensor({n + 1}, 99));
    Tensor view = offset_view ? whole.flat_view(1, {n}) : whole.flat_view(0, {n});
    view.copy_(host_view);
    return view;
  };
  const Tensor ga = gpu_view(a), gb = gpu_view(b), gy_sig = gpu_view(y_sig);

  Tensor out = Tensor::empty({n}), gout = gpu_view(Tensor::zeros({n}));
  ops::add(a, b, out);
  ops::add(ga, gb, gout);
  require_same_bits(gout, out);

  Tensor acc = a.clone(), gacc = gpu_view(a);
  ops::add_(acc, b, -0.37f);
  ops::add_(gacc, gb, -0.37f);
  require_same_bits(gacc, acc);

  Tensor scaled = a.clone(), gscaled = gpu_view(a);
  ops::scale_(scaled, 1.7f);
  ops::scale_(gscaled, 1.7f);
  require_same_bits(gscaled, scaled);

  Tensor relu = Tensor::empty({n}), grelu = gpu_view(Tensor::zeros({n}));
  ops::relu_forward(a, relu);
  ops::relu_forward(ga, grelu);
  require_same_bits(grelu, relu);
  Tensor drelu = Tensor::empty({n}), gdrelu = gpu_view(Tensor::zeros({n}));
  ops::relu_backward(relu, b, drelu);
  ops::relu_backward(grelu, gb, gdrelu);
  require_same_bits(gdrelu, drelu);

  // The CPU runs oneDNN's logistic and the GPU 1 / (1 + expf(-x)); both are within a few
  // ulp of the exact value, so they agree to well under 1e-6 relative; a wrong formula
  // is off by far more.
  Tensor sig = Tensor::empty({n}), gsig = gpu_view(Tensor::zeros({n}));
  ops::sigmoid_forward(a, sig);
  ops::sigmoid_forward(ga, gsig);
  require_near(gsig, sig, 1e-7, 2e-6);
  Tensor dsig = Tensor::empty({n}), gdsig = gpu_view(Tensor::zeros({n}));
  ops::sigmoid_backward(y_sig, b, dsig);
  ops::sigmoid_backward(gy_sig, gb, gdsig);
  require_same_bits(gdsig, dsig);
}

TEST_CASE("GPU add may write into an input, and mixed devices are errors", "[cuda][elementwise]") {
  require_gpu();
  const Tensor a = random_tensor({1001}, 5), b = random_tensor({1001}, 6);
  Tensor expected = Tensor::empty({1001});
  ops::add(a, b, expected);
  Tensor ga = on_gpu(a);
  ops::add(ga, on_gpu(b), ga);
  require_same_bits(ga, expected);

  Tensor out = Tensor::empty({1001}, DType::Float32, kGpu);
  CHECK_THROWS_AS(ops::add(ga, b, out), InternalError);  // b on the CPU
  Tensor host_out = Tensor::empty({1001});
  CHECK_THROWS_AS(ops::relu_forward(ga, host_out), InternalError);
  CHECK_THROWS_AS(cuda_ops::relu_forward(a, host_out), InternalError);  // no GPU tensor at all
  Tensor wrong_shape = Tensor::empty({1000}, DType::Float32, kGpu);
  CHECK_THROWS_AS(ops::add(ga, ga, wrong_shape), InternalError);
}

TEST_CASE("GPU copy_channels equals the CPU's", "[cuda][channels]") {
  require_gpu();
  const Tensor a = random_tensor({3, 4, 5, 7}, 7);
  Tensor cpu_out = Tensor::zeros({3, 9, 5, 7});
  ops::copy_channels(a, 1, cpu_out, 5, 3);
  Tensor gpu_out = on_gpu(Tensor::zeros({3, 9, 5, 7}));
  ops::copy_channels(on_gpu(a), 1, gpu_out, 5, 3);
  require_same_bits(gpu_out, cpu_out);
}

TEST_CASE("GPU scale_channels and channel_dot with one value per channel equal the CPU's", "[cuda][channels]") {
  require_gpu();
  const Tensor x = random_tensor({5, 6, 7, 3}, 21), dy = random_tensor({5, 6, 7, 3}, 22), s = random_tensor({6}, 23);
  Tensor y = Tensor::empty(x.shape()), gy = on_gpu(Tensor::empty(x.shape()));
  ops::scale_channels(x, s, y);
  ops::scale_channels(on_gpu(x), on_gpu(s), gy);
  require_same_bits(gy, y);
  Tensor dot = Tensor::empty({6}), gdot = on_gpu(Tensor::empty({6}));
  ops::channel_dot(dy, x, dot);
  ops::channel_dot(on_gpu(dy), on_gpu(x), gdot);
  require_close(on_cpu(gdot), dot, 1e-6);  // double sums in another order, rounded to float
}

TEST_CASE("GPU permute equals the CPU's", "[cuda][channels]") {
  require_gpu();
  const Tensor x = random_tensor({3, 2, 29, 7, 5}, 7);
  Tensor cpu_out = Tensor::empty({3, 29, 2, 7, 5}), gpu_out = on_gpu(Tensor::empty({3, 29, 2, 7, 5}));
  ops::permute(x, {0, 2, 1, 3, 4}, cpu_out);
  ops::permute(on_gpu(x), {0, 2, 1, 3, 4}, gpu_out);
  require_same_bits(gpu_out, cpu_out);
  Tensor cpu_rev = Tensor::empty({5, 7, 29, 2, 3}), gpu_rev = on_gpu(Tensor::empty({5, 7, 29, 2, 3}));
  ops::permute(x, {4, 3, 2, 1, 0}, cpu_rev);
  ops::permute(on_gpu(x), {4, 3, 2, 1, 0}, gpu_rev);
  require_same_bits(gpu_rev, cpu_rev);
}

TEST_CASE("GPU mul, scale_channels, channel_dot and dropout_mask equal the CPU's", "[cuda][channels]") {
  require_gpu();
  const Tensor a = random_tensor({4, 6, 9, 9}, 8), b = random_tensor({4, 6, 9, 9}, 9), s = random_tensor({4, 6, 1, 1}, 10);
  Tensor prod = Tensor::empty(a.shape()), scaled = Tensor::empty(a.shape()), dot = Tensor::empty(s.shape());
  ops::mul(a, b, prod);
  ops::scale_channels(a, s, scaled);
  ops::channel_dot(a, b, dot);
  Tensor gprod = on_gpu(Tensor::empty(a.shape())), gscaled = on_gpu(Tensor::empty(a.shape()));
  Tensor gdot = on_gpu(Tensor::empty(s.shape()));
  ops::mul(on_gpu(a), on_gpu(b), gprod);
  ops::scale_channels(on_gpu(a), on_gpu(s), gscaled);
  ops::channel_dot(on_gpu(a), on_gpu(b), gdot);
  require_same_bits(gprod, prod);
  require_same_bits(gscaled, scaled);
  require_close(on_cpu(gdot), dot, 1e-6);  // double sums in another order, rounded to float
  Tensor mask = Tensor::empty({12345}), gmask = on_gpu(Tensor::empty({12345}));
  ops::dropout_mask(mask, 0.3f, 99);
  ops::dropout_mask(gmask, 0.3f, 99);
  require_same_bits(gmask, mask);
}

// ---- pooling ----------------------------------------------------------------------------

TEST_CASE("GPU pooling equals the CPU's, forward and backward", "[cuda][pool]") {
  require_gpu();
  struct Case {
    Shape x;
    Pool2dParams p;
  };
  const Case c = GENERATE(Case{{2, 3, 8, 8}, {2, 2, 2, 2, 0, 0}},     // tiled, as LeNet
                          Case{{2, 3, 9, 11}, {3, 3, 2, 2, 1, 1}},    // ResNet stem, odd size
                          Case{{1, 2, 7, 5}, {3, 3, 1, 1, 1, 1}},     // heavy overlap
                          Case{{3, 2, 10, 9}, {3, 2, 2, 1, 1, 0}},    // uneven window
                          Case{{2, 1, 5, 5}, {2, 2, 2, 2, 0, 0}},     // last row/col unused
                          Case{{0, 3, 6, 6}, {2, 2, 2, 2, 0, 0}},     // empty batch
                          Case{{4, 64, 57, 57}, {3, 3, 2, 2, 1, 1}},  // many planes
                          Case{{2, 3, 14, 13}, {3, 3, 2, 2, 0, 0, true}},  // ceil mode (max only)
                          Case{{2, 3, 5, 6}, {2, 2, 2, 2, 1, 1, true}});
  const bool ties = GENERATE(false, true);
  CAPTURE(shape_str(c.x), c.p.kernel_h, c.p.kernel_w, c.p.stride_h, c.p.stride_w, c.p.pad_h,
          c.p.pad_w, ties);
  const Shape ys = pooled_shape(c.x, c.p);
  const Tensor x = ties ? tied_tensor(c.x, 11) : random_tensor(c.x, 11);
  const Tensor dy = random_tensor(ys, 12);
  const Tensor gx = on_gpu(x), gdy = on_gpu(dy);

  // Max pooling: comparisons and copies only, and the backward adds in the CPU's order
  // (Note [Deterministic pooling backward]): exact.
  Tensor y = Tensor::empty(ys), idx = Tensor::empty(ys, DType::Int32);
  Tensor gy = Tensor::empty(ys, DType::Float32, kGpu), gidx = Tensor::empty(ys, DType::Int32, kGpu);
  ops::maxpool2d_forward(x, y, idx, c.p);
  ops::maxpool2d_forward(gx, gy, gidx, c.p);
  require_same_bits(gy, y);
  require_same_bits(gidx, idx);
  Tensor dx = Tensor::empty(c.x), gdx = Tensor::full(c.x, 7.0f).to(kGpu);  // stale values
  ops::maxpool2d_backward(dy, idx, dx);
  ops::maxpool2d_backward(gdy, gidx, gdx);
  require_same_bits(gdx, dx);

  if (c.p.ceil_mode) return;  // average pooling refuses it
  // Average pooling: the same sums in the same order: exact.
  Tensor avg = Tensor::empty(ys), gavg = Tensor::empty(ys, DType::Float32, kGpu);
  ops::avgpool2d_forward(x, avg, c.p);
  ops::avgpool2d_forward(gx, gavg, c.p);
  require_same_bits(gavg, avg);
  Tensor davg = Tensor::empty(c.x), gdavg = Tensor::full(c.x, 7.0f).to(kGpu);
  ops::avgpool2d_backward(dy, davg, c.p);
  ops::avgpool2d_backward(gdy, gdavg, c.p);
  require_same_bits(gdavg, davg);
}

TEST_CASE("GPU max pooling keeps NaN like the CPU", "[cuda][pool]") {
  require_gpu();
  Tensor x = random_tensor({1, 2, 6, 6}, 13);
  x.data<float>()[7] = NAN;
  x.data<float>()[8] = NAN;  // a later NaN in the same window replaces the first
  x.data<float>()[50] = NAN;
  const Pool2dParams p{3, 3, 2, 2, 1, 1};
  const Shape ys = pooled_shape(x.shape(), p);
  Tensor y = Tensor::empty(ys), idx = Tensor::empty(ys, DType::Int32);
  Tensor gy = Tensor::empty(ys, DType::Float32, kGpu), gidx = Tensor::empty(ys, DType::Int32, kGpu);
  ops::maxpool2d_forward(x, y, idx, p);
  ops::maxpool2d_forward(on_gpu(x), gy, gidx, p);
  require_same_bits(gy, y);
  require_same_bits(gidx, idx);
}

TEST_CASE("GPU global average pooling equals the CPU's", "[cuda][pool]") {
  require_gpu();
  const Shape shape = GENERATE(Shape{2, 3, 1, 1}, Shape{8, 512, 7, 7}, Shape{3, 5, 13, 17},
                               Shape{1, 2, 100, 100}, Shape{0, 4, 3, 3}, Shape{2, 3, 0, 4});
  CAPTURE(shape_str(shape));
  const Tensor x = random_tensor(shape, 21);
  const Shape ys{shape[0], shape[1], 1, 1};
  Tensor y = Tensor::empty(ys), gy = Tensor::empty(ys, DType::Float32, kGpu);
  ops::global_avgpool_forward(x, y);
  ops::global_avgpool_forward(on_gpu(x), gy);
  // The CPU sums a plane in vector lanes, the GPU in a warp tree: another order. For 10^4
  // values in [-1, 1] the float rounding of either sum is of order 1e-4 in practice, 1e-8
  // in the mean; 1e-6 leaves ample room and still catches a missed or doubled element,
  // which moves the mean by |x| / area, about 5e-5 for the largest plane.
  require_near(gy, y, 1e-6, 1e-5);

  const Tensor dy = random_tensor(ys, 22);
  Tensor dx = Tensor::empty(shape), gdx = Tensor::empty(shape, DType::Float32, kGpu);
  ops::global_avgpool_backward(dy, dx);
  ops::global_avgpool_backward(on_gpu(dy), gdx);
  require_same_bits(gdx, dx);
}

// ---- batch norm -------------------------------------------------------------------------

TEST_CASE("GPU batch norm equals the CPU's", "[cuda][batchnorm]") {
  require_gpu();
  // [N,C,H,W] and [N,C]; counts below and above one block's range (4096 elements), so the
  // partials are merged; an empty batch.
  const Shape shape = GENERATE(Shape{4, 3, 5, 7}, Shape{2, 5, 1, 1}, Shape{1, 2, 150, 151},
                               Shape{16, 64, 28, 28}, Shape{0, 3, 4, 4}, Shape{37, 11},
                               Shape{5000, 3}, Shape{1, 4}, Shape{0, 6});
  const bool with_affine = GENERATE(true, false);
  CAPTURE(shape_str(shape), with_affine);
  const int64_t c = shape[1];
  // An offset of 100 makes E[x^2] - E[x]^2 lose about 4 of float's 7 digits; the two-pass
  // variance of both kernels does not.
  const Tensor x = random_tensor(shape, 31, 99.0f, 101.0f);
  const Tensor dy = random_tensor(shape, 32);
  const Tensor gx = on_gpu(x), gdy = on_gpu(dy);

  Tensor mean = Tensor::empty({c}), var = Tensor::empty({c});
  Tensor gmean = Tensor::full({c}, NAN).to(kGpu), gvar = Tensor::full({c}, NAN).to(kGpu);
  ops::batchnorm_stats(x, mean, var);
  ops::batchnorm_stats(gx, gmean, gvar);
  // Both accumulate in double and round once to float; only the order of the double sums
  // differs, which moves the float result by at most one ulp (~1.2e-7 relative) and only
  // rarely. 1e-6 relative allows that; a lost chunk would move the mean by >1e-4.
  require_near(gmean, mean, 1e-9, 1e-6);
  require_near(gvar, var, 1e-9, 1e-6);
  // The reduction is deterministic: a second run gives the same bits.
  Tensor again_mean = Tensor::empty({c}, DType::Float32, kGpu);
  Tensor again_var = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_stats(gx, again_mean, again_var);
  require_same_bits(again_mean, on_cpu(gmean));
  require_same_bits(again_var, on_cpu(gvar));

  // The elementwise halves get identical per-channel inputs on both sides: exact.
  Tensor invstd = Tensor::empty({c});
  for (int64_t i = 0; i < c; ++i) {
    invstd.data<float>()[i] = static_cast<float>(1.0 / std::sqrt(var.data<float>()[i] + 1e-5));
  }
  const Tensor gamma = with_affine ? random_tensor({c}, 33, 0.5f, 1.5f) : Tensor();
  const Tensor beta = with_affine ? random_tensor({c}, 34) : Tensor();
  const Tensor ggamma = with_affine ? on_gpu(gamma) : Tensor();
  const Tensor gbeta = with_affine ? on_gpu(beta) : Tensor();
  const Tensor gmean_cpu = on_gpu(mean), ginvstd = on_gpu(invstd);
  Tensor y = Tensor::empty(shape), gy = Tensor::empty(shape, DType::Float32, kGpu);
  ops::batchnorm_apply(x, mean, invstd, gamma, beta, y);
  ops::batchnorm_apply(gx, gmean_cpu, ginvstd, ggamma, gbeta, gy);
  require_same_bits(gy, y);

  Tensor sum_dy = Tensor::empty({c}), sum_dy_xmu = Tensor::empty({c});
  Tensor gsum_dy = Tensor::empty({c}, DType::Float32, kGpu);
  Tensor gsum_dy_xmu = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_backward_reduce(dy, x, mean, sum_dy, sum_dy_xmu);
  ops::batchnorm_backward_reduce(gdy, gx, gmean_cpu, gsum_dy, gsum_dy_xmu);
  // As for the statistics: double sums in another order. The sums of random-sign terms
  // can be small, hence the absolute part (far below one term's size, 1).
  require_near(gsum_dy, sum_dy, 1e-6, 1e-6);
  require_near(gsum_dy_xmu, sum_dy_xmu, 1e-6, 1e-6);

  // A global count, as SyncBatchNorm passes (three ranks' worth), and the local one.
  const int64_t area = shape.size() == 4 ? shape[2] * shape[3] : 1;
  const double local = static_cast<double>(shape[0] * area);
  for (const double count : {local, 3.0 * local}) {
    Tensor dx = Tensor::empty(shape), gdx = Tensor::empty(shape, DType::Float32, kGpu);
    ops::batchnorm_backward_apply(dy, x, mean, invstd, gamma, sum_dy, sum_dy_xmu, count, dx);
    ops::batchnorm_backward_apply(gdy, gx, gmean_cpu, ginvstd, ggamma, on_gpu(sum_dy),
                                  on_gpu(sum_dy_xmu), count, gdx);
    require_same_bits(gdx, dx);
  }
}

TEST_CASE("GPU one-pass batch-norm statistics equal the CPU's", "[cuda][batchnorm]") {
  require_gpu();
  cuda_ops::NumericsOptions one_pass = cuda_ops::numerics();
  one_pass.batchnorm_one_pass = true;
  const testing::NumericsScope scope(one_pass);
  const Shape shape = GENERATE(Shape{4, 3, 5, 7}, Shape{2, 5, 1, 1}, Shape{1, 2, 150, 151},
                               Shape{16, 64, 28, 28}, Shape{0, 3, 4, 4}, Shape{5000, 3},
                               Shape{1, 4});
  // Around 0, around 100 (where E[x^2] - E[x]^2 in float would lose 4 digits) and a tiny
  // spread around 1e6; Note [One-pass batch-norm statistics] shifts by a sample.
  const float offset = GENERATE(0.0f, 100.0f, 1e6f);
  const float spread = offset == 1e6f ? 0.25f : 1.0f;
  CAPTURE(shape_str(shape), offset);
  const int64_t c = shape[1];
  const Tensor x = random_tensor(shape, 36, offset - spread, offset + spread);
  Tensor mean = Tensor::empty({c}), var = Tensor::empty({c});
  ops::batchnorm_stats(x, mean, var);
  const Tensor gx = on_gpu(x);
  Tensor gmean = Tensor::full({c}, NAN).to(kGpu), gvar = Tensor::full({c}, NAN).to(kGpu);
  ops::batchnorm_stats(gx, gmean, gvar);
  // The CPU's two passes and these shifted sums are both double throughout and round once
  // to float: an ulp apart at most, rarely. The variance's absolute part covers a
  // variance of 0 (one element per channel), which both give exactly.
  require_near(gmean, mean, 0.0, 1e-6);
  require_near(gvar, var, 1e-12, 1e-6);
  Tensor again_mean = Tensor::empty({c}, DType::Float32, kGpu);
  Tensor again_var = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_stats(gx, again_mean, again_var);
  require_same_bits(again_mean, gmean);
  require_same_bits(again_var, gvar);
}

// Note [Fused batch norm] in tensor/ops.h: the GPU's fused kernels do the CPU's float
// operations in its order (exact), and their unfused GPU sequence's (exact); only the
// reduce sums in double in another order than the CPU.
TEST_CASE("GPU fused batch norm equals the CPU's and its unfused sequence", "[cuda][batchnorm]") {
  require_gpu();
  const Shape shape = GENERATE(Shape{4, 3, 5, 7}, Shape{16, 64, 28, 28}, Shape{37, 11},
                               Shape{0, 3, 4, 4});
  const bool add = GENERATE(false, true);
  CAPTURE(shape_str(shape), add);
  const int64_t c = shape[1];
  const Tensor x = random_tensor(shape, 37, -2.0f, 2.0f);
  const Tensor residual = add ? random_tensor(shape, 38) : Tensor();
  const Tensor dy = random_tensor(shape, 39);
  const Tensor mean = random_tensor({c}, 40, -0.5f, 0.5f);
  const Tensor invstd = random_tensor({c}, 41, 0.5f, 2.0f);
  const Tensor gamma = random_tensor({c}, 42, 0.5f, 1.5f);
  const Tensor beta = random_tensor({c}, 43);
  const Tensor gx = on_gpu(x), gdy = on_gpu(dy), gres = add ? on_gpu(residual) : Tensor();
  const Tensor gmean = on_gpu(mean), ginvstd = on_gpu(invstd), ggamma = on_gpu(gamma);
  const Tensor gbeta = on_gpu(beta);

  Tensor y = Tensor::empty(shape), gy = Tensor::empty(shape, DType::Float32, kGpu);
  ops::batchnorm_apply_relu(x, mean, invstd, gamma, beta, residual, y);
  ops::batchnorm_apply_relu(gx, gmean, ginvstd, ggamma, gbeta, gres, gy);
  require_same_bits(gy, y);
  // The unfused sequence on the GPU: apply, add, relu.
  Tensor gbn = Tensor::empty(shape, DType::Float32, kGpu);
  ops::batchnorm_apply(gx, gmean, ginvstd, ggamma, gbeta, gbn);
  if (add) ops::add(gbn, gres, gbn);
  Tensor gunfused = Tensor::empty(shape, DType::Float32, kGpu);
  ops::relu_forward(gbn, gunfused);
  require_same_bits(gy, gunfused);

  Tensor sum_dy = Tensor::empty({c}), sum_dy_xmu = Tensor::empty({c});
  ops::batchnorm_backward_reduce_relu(dy, y, x, mean, sum_dy, sum_dy_xmu);
  Tensor gsum_dy = Tensor::empty({c}, DType::Float32, kGpu);
  Tensor gsum_dy_xmu = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_backward_reduce_relu(gdy, gy, gx, gmean, gsum_dy, gsum_dy_xmu);
  require_near(gsum_dy, sum_dy, 1e-6, 1e-6);
  require_near(gsum_dy_xmu, sum_dy_xmu, 1e-6, 1e-6);
  Tensor gmasked = Tensor::empty(shape, DType::Float32, kGpu);
  ops::relu_backward(gy, gdy, gmasked);
  Tensor unfused_sum_dy = Tensor::empty({c}, DType::Float32, kGpu);
  Tensor unfused_sum_dy_xmu = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_backward_reduce(gmasked, gx, gmean, unfused_sum_dy, unfused_sum_dy_xmu);
  require_same_bits(gsum_dy, unfused_sum_dy);
  require_same_bits(gsum_dy_xmu, unfused_sum_dy_xmu);

  // The CPU's sums on both sides: the elementwise pass is exact.
  const double count = static_cast<double>(std::max<int64_t>(x.numel() / c, 1));
  Tensor dx = Tensor::empty(shape), dmasked = Tensor::empty(shape);
  Tensor gdx = Tensor::empty(shape, DType::Float32, kGpu);
  Tensor gdmasked = Tensor::empty(shape, DType::Float32, kGpu);
  Tensor none;
  ops::batchnorm_backward_apply_relu(dy, y, x, mean, invstd, gamma, sum_dy, sum_dy_xmu, count, dx,
                                     add ? dmasked : none);
  ops::batchnorm_backward_apply_relu(gdy, gy, gx, gmean, ginvstd, ggamma, on_gpu(sum_dy),
                                     on_gpu(sum_dy_xmu), count, gdx, add ? gdmasked : none);
  require_same_bits(gdx, dx);
  if (add) require_same_bits(gdmasked, dmasked);
  Tensor gunfused_dx = Tensor::empty(shape, DType::Float32, kGpu);
  ops::batchnorm_backward_apply(gmasked, gx, gmean, ginvstd, ggamma, on_gpu(sum_dy),
                                on_gpu(sum_dy_xmu), count, gunfused_dx);
  require_same_bits(gdx, gunfused_dx);
}

TEST_CASE("GPU batchnorm_prepare equals the CPU's", "[cuda][batchnorm]") {
  require_gpu();
  const int64_t c = GENERATE(1, 3, 300, 513);
  CAPTURE(c);
  const Tensor mean = random_tensor({c}, 44, -3.0f, 3.0f);
  const Tensor var = random_tensor({c}, 45, 0.0f, 4.0f);
  Tensor rm = random_tensor({c}, 46), rv = random_tensor({c}, 47, 0.5f, 2.0f);
  Tensor grm = on_gpu(rm), grv = on_gpu(rv);
  Tensor tracked = Tensor::zeros({}, DType::Int64), gtracked = on_gpu(tracked);
  Tensor invstd = Tensor::empty({c}), ginvstd = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_prepare(mean, var, 12, 0.1, 1e-5, rm, rv, tracked, invstd);
  ops::batchnorm_prepare(on_gpu(mean), on_gpu(var), 12, 0.1, 1e-5, grm, grv, gtracked, ginvstd);
  require_same_bits(grm, rm);
  require_same_bits(grv, rv);
  require_same_bits(ginvstd, invstd);
  require_same_bits(gtracked, tracked);
}

// Note [Channels last] in tensor/ops.h.
TEST_CASE("GPU channels-last layout changes and pooling equal the CPU's", "[cuda][channels_last]") {
  require_gpu();
  const Shape shape = GENERATE(Shape{2, 3, 4, 5}, Shape{16, 64, 28, 28}, Shape{3, 33, 7, 65},
                               Shape{512, 256, 3, 3}, Shape{0, 3, 2, 2}, Shape{70000, 2, 1, 1});
  CAPTURE(shape_str(shape));
  const Tensor x = random_tensor(shape, 48);
  const Shape last_shape = {shape[0], shape[2], shape[3], shape[1]};
  Tensor y = Tensor::empty(last_shape), gy = Tensor::empty(last_shape, DType::Float32, kGpu);
  ops::to_channels_last(x, y);
  ops::to_channels_last(on_gpu(x), gy);
  require_same_bits(gy, y);
  Tensor back = Tensor::empty(shape, DType::Float32, kGpu);
  ops::from_channels_last(gy, back);
  require_same_bits(back, x);

  Tensor pooled = Tensor::empty({shape[0], 1, 1, shape[1]});
  Tensor gpooled = Tensor::empty({shape[0], 1, 1, shape[1]}, DType::Float32, kGpu);
  ops::global_avgpool_forward_channels_last(y, pooled);
  ops::global_avgpool_forward_channels_last(gy, gpooled);
  require_same_bits(gpooled, pooled);  // the same float sums in the same order
  const Tensor dy = random_tensor({shape[0], 1, 1, shape[1]}, 49);
  Tensor dx = Tensor::empty(last_shape), gdx = Tensor::empty(last_shape, DType::Float32, kGpu);
  ops::global_avgpool_backward_channels_last(dy, dx);
  ops::global_avgpool_backward_channels_last(on_gpu(dy), gdx);
  require_same_bits(gdx, dx);
}

// Note [Batch-norm reductions over rows]: an [M, C] input (a channels-last activation's
// view) takes the column kernel; the sums equal the CPU's up to the order of double adds.
TEST_CASE("GPU batch norm over rows equals the CPU's", "[cuda][batchnorm]") {
  require_gpu();
  const Shape shape = GENERATE(Shape{16 * 28 * 28, 64}, Shape{37, 11}, Shape{5000, 3}, Shape{256 * 16, 512},
                               Shape{1, 40}, Shape{100, 1000});
  const bool one_pass = GENERATE(false, true);
  CAPTURE(shape_str(shape), one_pass);
  cuda_ops::NumericsOptions numerics = cuda_ops::numerics();
  numerics.batchnorm_one_pass = one_pass;
  const testing::NumericsScope scope(numerics);
  const int64_t c = shape[1];
  const Tensor x = random_tensor(shape, 50, 99.0f, 101.0f), dy = random_tensor(shape, 51);
  Tensor mean = Tensor::empty({c}), var = Tensor::empty({c});
  ops::batchnorm_stats(x, mean, var);
  Tensor gmean = Tensor::empty({c}, DType::Float32, kGpu), gvar = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_stats(on_gpu(x), gmean, gvar);
  require_near(gmean, mean, 1e-9, 1e-6);
  require_near(gvar, var, 1e-9, 1e-6);
  Tensor sum_dy = Tensor::empty({c}), sum_dy_xmu = Tensor::empty({c});
  ops::batchnorm_backward_reduce(dy, x, mean, sum_dy, sum_dy_xmu);
  Tensor gsum_dy = Tensor::empty({c}, DType::Float32, kGpu), gsum_dy_xmu = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_backward_reduce(on_gpu(dy), on_gpu(x), on_gpu(mean), gsum_dy, gsum_dy_xmu);
  require_near(gsum_dy, sum_dy, 1e-6, 1e-6);
  require_near(gsum_dy_xmu, sum_dy_xmu, 1e-6, 1e-6);
}

TEST_CASE("GPU batch norm checks devices and shapes", "[cuda][batchnorm]") {
  require_gpu();
  const Tensor gx = on_gpu(random_tensor({2, 3, 4, 4}, 35));
  Tensor host_mean = Tensor::empty({3});
  Tensor gvar = Tensor::empty({3}, DType::Float32, kGpu);
  CHECK_THROWS_AS(ops::batchnorm_stats(gx, host_mean, gvar), InternalError);
  Tensor wrong = Tensor::empty({4}, DType::Float32, kGpu);
  CHECK_THROWS_AS(ops::batchnorm_stats(gx, wrong, gvar), InternalError);
  Tensor gy = Tensor::empty({2, 3, 4, 4}, DType::Float32, kGpu);
  const Tensor host_gamma = Tensor::full({3}, 1.0f);
  CHECK_THROWS_AS(ops::batchnorm_apply(gx, gvar, gvar, host_gamma, Tensor(), gy), InternalError);
}

// ---- 16-bit activations ------------------------------------------------------------------
// Note [16-bit activations] in tensor/ops.h: the GPU entries below read and write bfloat16
// or float16 activations themselves. The reference is what the dispatcher's fallback
// computes: the CPU's float32 op on the same (16-bit) values, its result rounded to 16
// bits. The entries are called directly (cuda_ops::), whatever the dispatch does.

namespace {

// `t` (on the CPU) converted to `to` (float32 <-> 16-bit) on the CPU.
Tensor converted(const Tensor& t, DType to) {
  Tensor out = Tensor::empty(t.shape(), to);
  ops::convert(t, out);
  return out;
}

// Values rounded to a 16-bit `storage` type: `wide`, them in float32 on the CPU (the
// reference's input), `gpu`, them in `storage` on the GPU.
struct Stored {
  Tensor wide, gpu;
};

Stored stored(const Tensor& values, DType storage) {
  const Tensor half = converted(values, storage);
  return {converted(half, DType::Float32), on_gpu(half)};
}

// A GPU output in `storage`, NaN until written.
Tensor nan_output(const Shape& shape, DType storage) { return on_gpu(converted(Tensor::full(shape, NAN), storage)); }

// The 16-bit GPU result equals the CPU's float32 result rounded to its type, bit for bit.
void require_rounded(const Tensor& gpu16, const Tensor& cpu32) {
  require_same_bits(gpu16, converted(cpu32, gpu16.dtype()));
}

}  // namespace

TEST_CASE("GPU add, add_ and ReLU on 16-bit activations equal the CPU's float32 ops rounded", "[cuda][storage16]") {
  require_gpu();
  const DType storage = GENERATE(DType::BFloat16, DType::Float16);
  const int64_t n = GENERATE(0, 1, 1027, (1 << 20) + 5);
  CAPTURE(dtype_name(storage), n);
  const Stored a = stored(random_tensor({n}, 71, -2.0f, 2.0f), storage);
  const Stored b = stored(random_tensor({n}, 72, -2.0f, 2.0f), storage);

  Tensor sum = Tensor::empty({n}), gsum = nan_output({n}, storage);
  ops::add(a.wide, b.wide, sum);
  cuda_ops::add(a.gpu, b.gpu, gsum);
  require_rounded(gsum, sum);
  Tensor acc = a.wide.clone(), gacc = on_gpu(on_cpu(a.gpu));  // in place, as ops.h allows
  ops::add_(acc, b.wide, -0.37f);
  cuda_ops::add_(gacc, b.gpu, -0.37f);
  require_rounded(gacc, acc);

  Tensor relu = Tensor::empty({n}), grelu = nan_output({n}, storage);
  ops::relu_forward(a.wide, relu);
  cuda_ops::relu_forward(a.gpu, grelu);
  require_rounded(grelu, relu);
  Tensor drelu = Tensor::empty({n}), gdrelu = nan_output({n}, storage);
  ops::relu_backward(a.wide, b.wide, drelu);  // a as the ReLU's output: negatives mask too
  cuda_ops::relu_backward(a.gpu, b.gpu, gdrelu);
  require_rounded(gdrelu, drelu);
}

TEST_CASE("GPU batch norm on 16-bit activations equals the CPU's float32 batch norm rounded", "[cuda][storage16]") {
  require_gpu();
  const DType storage = GENERATE(DType::BFloat16, DType::Float16);
  const Shape shape = GENERATE(Shape{4, 3, 5, 7}, Shape{16, 64, 28, 28}, Shape{1, 2, 150, 151}, Shape{37, 11},
                               Shape{5000, 3}, Shape{0, 3, 4, 4});
  const bool one_pass = GENERATE(false, true);
  CAPTURE(dtype_name(storage), shape_str(shape), one_pass);
  cuda_ops::NumericsOptions numerics = cuda_ops::numerics();
  numerics.batchnorm_one_pass = one_pass;
  const testing::NumericsScope scope(numerics);
  const int64_t c = shape[1];
  const Stored x = stored(random_tensor(shape, 73, -2.0f, 3.0f), storage);
  const Stored dy = stored(random_tensor(shape, 74), storage);
  const Stored residual = stored(random_tensor(shape, 75), storage);
  const auto gpu_channels = [&] { return Tensor::full({c}, NAN).to(kGpu); };

  // Statistics (float32) of the same values: double sums in another order, as in "GPU
  // batch norm equals the CPU's".
  Tensor mean = Tensor::empty({c}), var = Tensor::empty({c}), gmean = gpu_channels(), gvar = gpu_channels();
  ops::batchnorm_stats(x.wide, mean, var);
  cuda_ops::batchnorm_stats(x.gpu, gmean, gvar);
  require_near(gmean, mean, 1e-9, 1e-6);
  require_near(gvar, var, 1e-9, 1e-6);

  // The elementwise halves from identical per-channel inputs: exact after rounding.
  Tensor invstd = Tensor::empty({c});
  for (int64_t i = 0; i < c; ++i) {
    invstd.data<float>()[i] = static_cast<float>(1.0 / std::sqrt(var.data<float>()[i] + 1e-5));
  }
  const Tensor gamma = random_tensor({c}, 76, 0.5f, 1.5f), beta = random_tensor({c}, 77);
  const Tensor gm = on_gpu(mean), gi = on_gpu(invstd), gg = on_gpu(gamma), gb = on_gpu(beta);
  Tensor y = Tensor::empty(shape), gy = nan_output(shape, storage);
  ops::batchnorm_apply(x.wide, mean, invstd, gamma, beta, y);
  cuda_ops::batchnorm_apply(x.gpu, gm, gi, gg, gb, gy);
  require_rounded(gy, y);
  Tensor yr = Tensor::empty(shape), gyr = nan_output(shape, storage);
  ops::batchnorm_apply_relu(x.wide, mean, invstd, gamma, beta, Tensor(), yr);
  cuda_ops::batchnorm_apply_relu(x.gpu, gm, gi, gg, gb, Tensor(), gyr);
  require_rounded(gyr, yr);
  ops::batchnorm_apply_relu(x.wide, mean, invstd, gamma, beta, residual.wide, yr);
  cuda_ops::batchnorm_apply_relu(x.gpu, gm, gi, gg, gb, residual.gpu, gyr);
  require_rounded(gyr, yr);
  const Stored relu_out = stored(yr, storage);  // the fused ReLU's 16-bit output

  // Gradient sums (float32): as the statistics.
  Tensor sum_dy = Tensor::empty({c}), sum_dy_xmu = Tensor::empty({c});
  Tensor gsum_dy = gpu_channels(), gsum_dy_xmu = gpu_channels();
  ops::batchnorm_backward_reduce(dy.wide, x.wide, mean, sum_dy, sum_dy_xmu);
  cuda_ops::batchnorm_backward_reduce(dy.gpu, x.gpu, gm, gsum_dy, gsum_dy_xmu);
  require_near(gsum_dy, sum_dy, 1e-6, 1e-6);
  require_near(gsum_dy_xmu, sum_dy_xmu, 1e-6, 1e-6);
  Tensor rsum_dy = Tensor::empty({c}), rsum_dy_xmu = Tensor::empty({c});
  ops::batchnorm_backward_reduce_relu(dy.wide, relu_out.wide, x.wide, mean, rsum_dy, rsum_dy_xmu);
  cuda_ops::batchnorm_backward_reduce_relu(dy.gpu, relu_out.gpu, x.gpu, gm, gsum_dy, gsum_dy_xmu);
  require_near(gsum_dy, rsum_dy, 1e-6, 1e-6);
  require_near(gsum_dy_xmu, rsum_dy_xmu, 1e-6, 1e-6);

  // The backward applies from the CPU's sums on both sides: exact after rounding.
  const int64_t area = shape.size() == 4 ? shape[2] * shape[3] : 1;
  const double count = static_cast<double>(std::max<int64_t>(shape[0] * area, 1));
  Tensor dx = Tensor::empty(shape), gdx = nan_output(shape, storage);
  ops::batchnorm_backward_apply(dy.wide, x.wide, mean, invstd, gamma, sum_dy, sum_dy_xmu, count, dx);
  cuda_ops::batchnorm_backward_apply(dy.gpu, x.gpu, gm, gi, gg, on_gpu(sum_dy), on_gpu(sum_dy_xmu), count, gdx);
  require_rounded(gdx, dx);
  Tensor dmasked = Tensor::empty(shape), gdmasked = nan_output(shape, storage);
  ops::batchnorm_backward_apply_relu(dy.wide, relu_out.wide, x.wide, mean, invstd, gamma, rsum_dy, rsum_dy_xmu, count,
                                     dx, dmasked);
  cuda_ops::batchnorm_backward_apply_relu(dy.gpu, relu_out.gpu, x.gpu, gm, gi, gg, on_gpu(rsum_dy),
                                          on_gpu(rsum_dy_xmu), count, gdx, gdmasked);
  require_rounded(gdx, dx);
  require_rounded(gdmasked, dmasked);
}

TEST_CASE("GPU activations of mixed dtypes are internal errors", "[cuda][storage16]") {
  require_gpu();
  const Tensor a16 = on_gpu(converted(random_tensor({64}, 78), DType::BFloat16));
  const Tensor a32 = on_gpu(random_tensor({64}, 79));
  Tensor out16 = Tensor::empty({64}, DType::BFloat16, kGpu), out32 = Tensor::empty({64}, DType::Float32, kGpu);
  CHECK_THROWS_AS(cuda_ops::add(a16, a32, out16), InternalError);
  CHECK_THROWS_WITH(cuda_ops::add(a16, a32, out16),
                    Catch::Contains("add") && Catch::Contains("a bfloat16") && Catch::Contains("b float32"));
  CHECK_THROWS_AS(cuda_ops::add_(out16, a32, 1.0f), InternalError);
  CHECK_THROWS_AS(cuda_ops::relu_forward(a16, out32), InternalError);
  Tensor half = Tensor::empty({64}, DType::Float16, kGpu);
  CHECK_THROWS_AS(cuda_ops::relu_backward(a16, a16, half), InternalError);
  Tensor ints = Tensor::zeros({64}, DType::Int32, kGpu);
  CHECK_THROWS_AS(cuda_ops::relu_forward(ints, ints), InternalError);

  const Tensor x16 = on_gpu(converted(random_tensor({2, 3, 4, 4}, 80), DType::BFloat16));
  const Tensor mean = on_gpu(random_tensor({3}, 81)), invstd = on_gpu(random_tensor({3}, 82, 0.5f, 2.0f));
  Tensor y32 = Tensor::empty({2, 3, 4, 4}, DType::Float32, kGpu);
  Tensor y16 = Tensor::empty({2, 3, 4, 4}, DType::BFloat16, kGpu);
  CHECK_THROWS_WITH(cuda_ops::batchnorm_apply(x16, mean, invstd, Tensor(), Tensor(), y32),
                    Catch::Contains("batchnorm_apply") && Catch::Contains("y float32"));
  // The per-channel tensors stay float32.
  const Tensor mean16 = on_gpu(converted(random_tensor({3}, 83), DType::BFloat16));
  CHECK_THROWS_AS(cuda_ops::batchnorm_apply(x16, mean16, invstd, Tensor(), Tensor(), y16), InternalError);
  Tensor sum_dy = Tensor::empty({3}, DType::Float32, kGpu), sum_dy_xmu = Tensor::empty({3}, DType::Float32, kGpu);
  CHECK_THROWS_AS(cuda_ops::batchnorm_backward_reduce(y32, x16, mean, sum_dy, sum_dy_xmu), InternalError);
}

// ---- loss -------------------------------------------------------------------------------

TEST_CASE("GPU cross_entropy and count_correct equal the CPU's", "[cuda][loss]") {
  require_gpu();
  const int64_t n = GENERATE(1, 37, 1000);
  const int64_t k = GENERATE(1, 10, 33, 1000);
  CAPTURE(n, k);
  const Tensor logits = random_tensor({n, k}, 41, -8.0f, 8.0f);
  std::mt19937 gen(42);
  std::vector<int64_t> label_values(static_cast<size_t>(n));
  for (auto& l : label_values) l = std::uniform_int_distribution<int64_t>(0, k - 1)(gen);
  const Tensor labels = Tensor::from_vector(label_values, {n});
  const Tensor glogits = on_gpu(logits), glabels = on_gpu(labels);

  const float scale = 1.0f / static_cast<float>(n);
  Tensor d = Tensor::empty({n, k}), gd = Tensor::empty({n, k}, DType::Float32, kGpu);
  const double loss = ops::cross_entropy(logits, labels, d, scale);
  const double gloss = ops::cross_entropy(glogits, glabels, gd, scale);
  // Double throughout on both sides, summed in another order: agreement to ~1e-15.
  CHECK(gloss == Approx(loss).epsilon(1e-10));
  // Each gradient is a double rounded to float, then scaled: at most one ulp apart.
  require_near(gd, d, 1e-9, 1e-6);
  Tensor none;
  CHECK(ops::cross_entropy(glogits, glabels, none, 1.0f) == Approx(loss).epsilon(1e-10));

  // Quantised logits have ties; the first maximum must win on both.
  const Tensor tied = tied_tensor({n, k}, 43);
  CHECK(ops::count_correct(on_gpu(tied), glabels) == ops::count_correct(tied, labels));
  CHECK(ops::count_correct(glogits, glabels) == ops::count_correct(logits, labels));
}

TEST_CASE("GPU loss: huge logits, NaN rows, empty batches", "[cuda][loss]") {
  require_gpu();
  const Tensor logits = Tensor::from_vector<float>({1000, 0, -1000, 0}, {2, 2});
  const Tensor labels = Tensor::from_vector<int64_t>({1, 0}, {2});
  Tensor gd = Tensor::empty({2, 2}, DType::Float32, kGpu);
  CHECK(ops::cross_entropy(on_gpu(logits), on_gpu(labels), gd, 1.0f) == Approx(2000.0));
  require_near(gd, Tensor::from_vector<float>({1, -1, -1, 1}, {2, 2}), 1e-6, 0);

  // Row 0 starts with NaN (argmax 0 on the CPU); row 1 has a NaN later (skipped); row 2 is
  // all equal (first wins).
  const Tensor odd = Tensor::from_vector<float>({NAN, 5, 1, 2, NAN, 3, 4, 4, 4}, {3, 3});
  for (const auto& l : {std::vector<int64_t>{0, 2, 0}, std::vector<int64_t>{1, 1, 2}}) {
    const Tensor lab = Tensor::from_vector(l, {3});
    CHECK(ops::count_correct(on_gpu(odd), on_gpu(lab)) == ops::count_correct(odd, lab));
  }

  const Tensor empty_logits = Tensor::empty({0, 5}, DType::Float32, kGpu);
  const Tensor empty_labels = Tensor::empty({0}, DType::Int64, kGpu);
  Tensor empty_d = Tensor::empty({0, 5}, DType::Float32, kGpu);
  CHECK(ops::cross_entropy(empty_logits, empty_labels, empty_d, 1.0f) == 0.0);
  CHECK(ops::count_correct(empty_logits, empty_labels) == 0);
}

TEST_CASE("GPU loss rejects labels outside [0, K) like the CPU", "[cuda][loss]") {
  require_gpu();
  const Tensor glogits = on_gpu(random_tensor({4, 10}, 44));
  Tensor gd = Tensor::empty({4, 10}, DType::Float32, kGpu);
  // Two bad rows: the first (row 1) is reported, with the CPU's wording.
  const Tensor high = on_gpu(Tensor::from_vector<int64_t>({3, 10, 2, 12}, {4}));
  CHECK_THROWS_WITH(ops::cross_entropy(glogits, high, gd, 1.0f),
                    Catch::Contains("label 10 of sample 1") && Catch::Contains("[0, 10)"));
  CHECK_THROWS_AS(ops::cross_entropy(glogits, high, gd, 1.0f), InvalidArgument);
  const Tensor negative = on_gpu(Tensor::from_vector<int64_t>({0, 1, 2, -1}, {4}));
  CHECK_THROWS_WITH(ops::count_correct(glogits, negative), Catch::Contains("label -1 of sample 3"));
  CHECK_THROWS_AS(ops::count_correct(glogits, negative), InvalidArgument);
  // Mixed devices and a wrong label dtype are bugs in the caller.
  const Tensor host_labels = Tensor::from_vector<int64_t>({0, 1, 2, 3}, {4});
  CHECK_THROWS_AS(ops::cross_entropy(glogits, host_labels, gd, 1.0f), InternalError);
  const Tensor int32_labels = on_gpu(Tensor::from_vector<int32_t>({0, 1, 2, 3}, {4}));
  CHECK_THROWS_AS(ops::count_correct(glogits, int32_labels), InternalError);
  // The stream is still usable after a reported bad label.
  const Tensor good = on_gpu(host_labels);
  CHECK(ops::count_correct(glogits, good) == ops::count_correct(on_cpu(glogits), host_labels));
}

// ---- SGD --------------------------------------------------------------------------------

namespace {

struct SgdConfig {
  float lr, momentum, dampening, weight_decay;
  bool nesterov;
};

}  // namespace

TEST_CASE("GPU sgd_step and sgd_step_all equal the CPU's sgd_step", "[cuda][sgd]") {
  require_gpu();
  const SgdConfig c = GENERATE(SgdConfig{0.1f, 0.0f, 0.0f, 0.0f, false},
                               SgdConfig{0.05f, 0.0f, 0.0f, 5e-4f, false},
                               SgdConfig{0.1f, 0.9f, 0.0f, 5e-4f, false},
                               SgdConfig{0.1f, 0.9f, 0.3f, 1e-4f, false},
                               SgdConfig{0.1f, 0.9f, 0.0f, 1e-3f, true});
  CAPTURE(c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov);
  const bool use_momentum = c.momentum != 0.0f;
  // 100 tensors (more than one launch's tensor table), an empty one, and one of 6M
  // elements (more than one launch's chunk table, so it is carried across launches).
  std::vector<Shape> shapes;
  for (int i = 0; i < 100; ++i) shapes.push_back({1 + 37 * i});
  shapes.push_back({0});
  shapes.push_back({6 << 20});
  shapes.push_back({3, 3, 3, 64});
  std::vector<Tensor> cpu_p, cpu_buf, single_p, single_buf, fused_p, fused_buf, grads, ggrads;
  for (size_t i = 0; i < shapes.size(); ++i) {
    cpu_p.push_back(random_tensor(shapes[i], 500 + static_cast<uint32_t>(i)));
    single_p.push_back(on_gpu(cpu_p.back()));
    fused_p.push_back(on_gpu(cpu_p.back()));
    // NaN in the buffers: the first step must not read them.
    const Tensor garbage = use_momentum ? Tensor::full(shapes[i], NAN) : Tensor();
    cpu_buf.push_back(use_momentum ? garbage.clone() : Tensor());
    single_buf.push_back(use_momentum ? on_gpu(garbage) : Tensor());
    fused_buf.push_back(use_momentum ? on_gpu(garbage) : Tensor());
    grads.push_back(Tensor());
    ggrads.push_back(Tensor());
  }
  std::vector<ops::SgdParamRef> refs;
  for (size_t i = 0; i < shapes.size(); ++i) {
    refs.push_back({&fused_p[i], &ggrads[i], use_momentum ? &fused_buf[i] : nullptr});
  }
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      grads[i] = random_tensor(shapes[i], 900 + static_cast<uint32_t>(200 * step + i));
      ggrads[i] = on_gpu(grads[i]);
      ops::sgd_step(cpu_p[i], grads[i], cpu_buf[i], c.lr, c.momentum, c.dampening,
                    c.weight_decay, c.nesterov, step == 0);
      ops::sgd_step(single_p[i], ggrads[i], single_buf[i], c.lr, c.momentum, c.dampening,
                    c.weight_decay, c.nesterov, step == 0);
    }
    ops::sgd_step_all(refs, c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov, step == 0);
  }
  // The same float operations as the CPU, unfused: exact. And sgd_step_all runs
  // sgd_step's device function: exact too.
  for (size_t i = 0; i < shapes.size(); ++i) {
    CAPTURE(i);
    require_same_bits(single_p[i], cpu_p[i]);
    require_same_bits(fused_p[i], cpu_p[i]);
    if (use_momentum) {
      require_same_bits(single_buf[i], cpu_buf[i]);
      require_same_bits(fused_buf[i], cpu_buf[i]);
    }
  }
}

TEST_CASE("GPU sgd_step_all: empty list, mixed devices, missing buffers", "[cuda][sgd]") {
  require_gpu();
  ops::sgd_step_all({}, 0.1f, 0.9f, 0.0f, 0.0f, false, true);
  Tensor p = on_gpu(random_tensor({8}, 61)), g = on_gpu(random_tensor({8}, 62));
  Tensor host_p = random_tensor({8}, 63), host_g = random_tensor({8}, 64);
  const Tensor before = on_cpu(p);
  const std::vector<ops::SgdParamRef> mixed{{&p, &g, nullptr}, {&host_p, &host_g, nullptr}};
  CHECK_THROWS_AS(ops::sgd_step_all(mixed, 0.1f, 0.0f, 0.0f, 0.0f, false, true), InternalError);
  // Every entry is checked before anything runs: the GPU parameter is untouched.
  require_same_bits(p, before);
  const std::vector<ops::SgdParamRef> no_buffer{{&p, &g, nullptr}};
  CHECK_THROWS_AS(ops::sgd_step_all(no_buffer, 0.1f, 0.9f, 0.0f, 0.0f, false, true), InternalError);
  CHECK_THROWS_AS(ops::sgd_step_all(no_buffer, 0.1f, 0.0f, 0.5f, 0.0f, true, true), InternalError);
}

#else

TEST_CASE("builds without CUDA explain that the GPU kernels need CUDA", "[cuda]") {
  const Tensor x = Tensor::full({4}, 1.0f);
  Tensor y = Tensor::empty({4});
  CHECK_THROWS_WITH(cuda_ops::relu_forward(x, y), Catch::Contains("needs a build with CUDA"));
  CHECK_THROWS_WITH(cuda_ops::sgd_step_all({}, 0.1f, 0.0f, 0.0f, 0.0f, false, true),
                    Catch::Contains("needs a build with CUDA"));
  // A tensor borrowed with a GPU device reaches them through the dispatch.
  float host[4] = {};
  const Tensor on_gpu = Tensor::borrow(host, {4}, DType::Float32, Device::cuda(0));
  CHECK_THROWS_WITH(ops::relu_forward(on_gpu, y),
                    Catch::Contains("relu on a GPU needs a build with CUDA"));
  CHECK_FALSE(ops::compute_dtype_supported(DType::BFloat16, Device::cuda(0)));
}

#endif
