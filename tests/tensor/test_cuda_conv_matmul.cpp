// gpu: convolutions on cuDNN and matrix products on cuBLAS against the CPU kernels on the
// same random inputs, in every numerics mode (heuristics, benchmark, deterministic).
// Skips the whole binary without a GPU; the numerics settings are checked everywhere.
//
// Tolerances. The inputs are uniform in [-1, 1) and TF32 is off, so GPU and CPU compute
// the same float32 products and differ only in summation order and, for cuDNN's
// transform algorithms (Winograd, FFT), in the transforms' own rounding. The longest
// sums here have K <= 400 terms (weight gradients of the 3x5 case: 3 * 8 * 15), each a
// product of magnitude <= 1, so every sum is at most ~10 in magnitude for these random
// signs, and reordering it moves it by ~sqrt(K) * 2^-24 * 10, about 1e-5; the transform
// algorithms round at the same relative level (~1e-5 of the sum). A wrong kernel (padding,
// stride or transposition off by one, a missing bias, beta 0 instead of 1) moves some
// element by at least a whole product term, |x * w| being 0.25 on average. kAtol = 5e-4
// plus kRtol = 1e-4 of the value sits well above the first and far below the second.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "tensor/cuda_ops.h"
#include "tensor/cuda_devices.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tests/support/skip.h"
#include "tests/tensor/numerics_scope.h"
#include "tests/tensor/reference.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/cublas_loader.h"
#include "tensor/cuda/cudnn_graph.h"
#include "tensor/cuda/stream.h"
#include "tests/support/stream_gate.h"
#endif

using namespace mtrain;
using mtrain::cuda_ops::NumericsOptions;
using mtrain::ops::Conv2dParams;
using mtrain::testing::NumericsScope;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;

TEST_CASE("numerics settings start at PyTorch's defaults and round-trip every combination") {
  const NumericsOptions defaults = cuda_ops::numerics();
  CHECK_FALSE(defaults.cudnn_benchmark);
  CHECK_FALSE(defaults.deterministic);
  CHECK(defaults.allow_tf32);
  CHECK_FALSE(defaults.allow_tf32_matmul);
  CHECK_FALSE(defaults.batchnorm_one_pass);
  CHECK_FALSE(defaults.cudnn_graph_api);
  for (int bits = 0; bits < 64; ++bits) {
    NumericsOptions o;
    o.cudnn_benchmark = (bits & 1) != 0;
    o.deterministic = (bits & 2) != 0;
    o.allow_tf32 = (bits & 4) != 0;
    o.allow_tf32_matmul = (bits & 8) != 0;
    o.batchnorm_one_pass = (bits & 16) != 0;
    o.cudnn_graph_api = (bits & 32) != 0;
    NumericsScope scope(o);
    CHECK(cuda_ops::numerics() == o);
  }
  CHECK(cuda_ops::numerics() == defaults);
}

#ifdef MTRAIN_HAVE_CUDA

namespace {

// TF32 off everywhere: the GPU-against-CPU comparisons need float32 products.
NumericsOptions exact_float32(bool benchmark = false, bool deterministic = false) {
  NumericsOptions o;
  o.cudnn_benchmark = benchmark;
  o.deterministic = deterministic;
  o.allow_tf32 = false;
  o.allow_tf32_matmul = false;
  return o;
}

constexpr double kAtol = 5e-4;
constexpr double kRtol = 1e-4;

void require_gpu() {
  if (cuda_info().device_count == 0) testing::skip_test_binary(cuda_summary().c_str());
}

const Device kGpu = Device::cuda(0);

Tensor host(const Tensor& t) { return t.to(Device::cpu()); }

// An output the kernel must overwrite: NaN everywhere, so reading it (beta != 0 where
// it should be 0) shows up as NaN in the result.
Tensor poisoned(const Shape& shape, Device device) {
  Tensor t = Tensor::full(shape, std::numeric_limits<float>::quiet_NaN());
  return device.is_cpu() ? t : t.to(device);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  const Tensor ha = host(a), hb = host(b);
  return ha.shape() == hb.shape() && std::memcmp(ha.raw_data(), hb.raw_data(), ha.nbytes()) == 0;
}

// ---- convolution ------------------------------------------------------------------------

struct ConvCase {
  const char* name;
  int64_t n, c, h, w, o, kh, kw;
  Conv2dParams p;
  bool bias;
};

// The shapes training uses (ResNet's 7x7 stem, 3x3 blocks, 1x1 strided shortcuts,
// LeNet's 5x5), odd channel counts, batch 1 and a kernel, stride and padding that differ
// between height and width (so that swapping them cannot pass).
const std::vector<ConvCase>& conv_cases() {
  static const std::vector<ConvCase> cases = {
      {"3x3 pad 1", 2, 3, 9, 9, 5, 3, 3, {1, 1, 1, 1}, true},
      {"5x5 pad 2", 2, 5, 11, 10, 7, 5, 5, {1, 1, 2, 2}, true},
      {"3x3 stride 2 pad 1", 3, 4, 12, 13, 6, 3, 3, {2, 2, 1, 1}, true},
      {"1x1 stride 2 shortcut", 2, 8, 9, 9, 16, 1, 1, {2, 2, 0, 0}, false},
      {"7x7 stride 2 pad 3", 2, 3, 20, 18, 8, 7, 7, {2, 2, 3, 3}, true},
      {"batch 1, odd channels, no bias", 1, 5, 8, 8, 3, 3, 3, {1, 1, 1, 1}, false},
      {"3x5 kernel, stride 2x1, pad 1x2", 3, 3, 15, 15, 5, 3, 5, {2, 1, 1, 2}, true},
  };
  return cases;
}

Shape output_shape(const ConvCase& k) {
  return {k.n, k.o, ops::conv_out_size(k.h, k.kh, k.p.stride_h, k.p.pad_h),
          ops::conv_out_size(k.w, k.kw, k.p.stride_w, k.p.pad_w)};
}

// Host inputs of one case, from a fixed seed.
struct ConvInputs {
  Tensor x, w, b, dy, dw0, db0;  // dw0/db0: gradients already there when accumulating
};

ConvInputs conv_inputs(const ConvCase& k, uint32_t seed) {
  ConvInputs in;
  in.x = random_tensor({k.n, k.c, k.h, k.w}, seed);
  in.w = random_tensor({k.o, k.c, k.kh, k.kw}, seed + 1);
  if (k.bias) in.b = random_tensor({k.o}, seed + 2);
  in.dy = random_tensor(output_shape(k), seed + 3);
  in.dw0 = random_tensor({k.o, k.c, k.kh, k.kw}, seed + 4);
  in.db0 = random_tensor({k.o}, seed + 5);
  return in;
}

// Every op of one case on `device`, through ops:: (so the dispatch is tested too).
struct ConvOutputs {
  Tensor y, dx, dw, db, dw_acc, db_acc;
};

ConvOutputs run_conv(const ConvCase& k, const ConvInputs& in, Device device) {
  const Tensor x = in.x.to(device), w = in.w.to(device), dy = in.dy.to(device);
  const Tensor b = k.bias ? in.b.to(device) : Tensor();
  ConvOutputs out;
  out.y = poisoned(output_shape(k), device);
  ops::conv2d_forward(x, w, b, out.y, k.p);
  out.dx = poisoned(x.shape(), device);
  ops::conv2d_backward_data(dy, w, out.dx, k.p);
  out.dw = poisoned(w.shape(), device);
  out.db = poisoned({k.o}, device);
  ops::conv2d_backward_weights(x, dy, out.dw, out.db, k.p, /*accumulate=*/false);
  out.dw_acc = in.dw0.clone().to(device);
  out.db_acc = in.db0.clone().to(device);
  ops::conv2d_backward_weights(x, dy, out.dw_acc, out.db_acc, k.p, /*accumulate=*/true);
  return out;
}

// [N, C, H, W] <-> [N, H, W, C] on the tensor's device (Note [Channels last]).
Tensor channels_last(const Tensor& t) {
  Tensor out = Tensor::empty({t.size(0), t.size(2), t.size(3), t.size(1)}, DType::Float32, t.device());
  ops::to_channels_last(t, out);
  return out;
}
Tensor channels_first(const Tensor& t) {
  Tensor out = Tensor::empty({t.size(0), t.size(3), t.size(1), t.size(2)}, DType::Float32, t.device());
  ops::from_channels_last(t, out);
  return out;
}

// run_conv on the GPU with the activations channels last, the results back in NCHW.
ConvOutputs run_conv_channels_last(const ConvCase& k, const ConvInputs& in) {
  ConvCase cl = k;
  cl.p.channels_last = true;
  const Tensor x = channels_last(in.x.to(kGpu)), w = in.w.to(kGpu), dy = channels_last(in.dy.to(kGpu));
  const Tensor b = k.bias ? in.b.to(kGpu) : Tensor();
  ConvOutputs out;
  const Shape y = output_shape(k);
  Tensor y_last = poisoned({y[0], y[2], y[3], y[1]}, kGpu);
  ops::conv2d_forward(x, w, b, y_last, cl.p);
  out.y = channels_first(y_last);
  Tensor dx_last = poisoned(x.shape(), kGpu);
  ops::conv2d_backward_data(dy, w, dx_last, cl.p);
  out.dx = channels_first(dx_last);
  out.dw = poisoned(w.shape(), kGpu);
  out.db = poisoned({k.o}, kGpu);
  ops::conv2d_backward_weights(x, dy, out.dw, out.db, cl.p, /*accumulate=*/false);
  out.dw_acc = in.dw0.clone().to(kGpu);
  out.db_acc = in.db0.clone().to(kGpu);
  ops::conv2d_backward_weights(x, dy, out.dw_acc, out.db_acc, cl.p, /*accumulate=*/true);
  return out;
}

void require_conv_matches_cpu(const ConvCase& k, uint32_t seed, double atol = kAtol,
                              double rtol = kRtol, bool channels_last = false) {
  INFO("case: " << k.name << (channels_last ? ", channels last on the GPU" : ""));
  const ConvInputs in = conv_inputs(k, seed);
  const ConvOutputs cpu = run_conv(k, in, Device::cpu());
  const ConvOutputs gpu = channels_last ? run_conv_channels_last(k, in) : run_conv(k, in, kGpu);
  REQUIRE(gpu.y.device() == kGpu);
  {
    INFO("forward");
    require_close(host(gpu.y), cpu.y, atol, rtol);
  }
  {
    INFO("backward data");
    require_close(host(gpu.dx), cpu.dx, atol, rtol);
  }
  {
    INFO("backward weights, overwriting");
    require_close(host(gpu.dw), cpu.dw, atol, rtol);
    require_close(host(gpu.db), cpu.db, atol, rtol);
  }
  {
    INFO("backward weights, accumulating");
    require_close(host(gpu.dw_acc), cpu.dw_acc, atol, rtol);
    require_close(host(gpu.db_acc), cpu.db_acc, atol, rtol);
  }
}

// ---- matrix products ----------------------------------------------------------------------

// linear forward and backward of one configuration on `device`.
struct LinearOutputs {
  Tensor y, dx, dw, db;
};

LinearOutputs run_linear(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy,
                         const Tensor& dw0, const Tensor& db0, bool with_bias, bool want_dx,
                         bool accumulate, Device device) {
  LinearOutputs out;
  const Tensor xd = x.to(device), wd = w.to(device), dyd = dy.to(device);
  const Tensor bd = with_bias ? b.to(device) : Tensor();
  out.y = poisoned({x.size(0), w.size(0)}, device);
  ops::linear_forward(xd, wd, bd, out.y);
  out.dx = want_dx ? poisoned(x.shape(), device) : Tensor();
  out.dw = accumulate ? dw0.clone().to(device) : poisoned(w.shape(), device);
  out.db = with_bias ? (accumulate ? db0.clone().to(device) : poisoned({w.size(0)}, device))
                     : Tensor();
  ops::linear_backward(xd, wd, dyd, out.dx, out.dw, out.db, accumulate);
  return out;
}

}  // namespace

// Runs without a GPU: opening the library needs no driver. Note [cuBLAS is loaded lazily].
TEST_CASE("cuBLAS opens at first use and has every entry point mtrain calls") {
  const cuda::CublasApi& api = cuda::cublas();
  CHECK(api.create != nullptr);
  CHECK(api.destroy != nullptr);
  CHECK(api.set_stream != nullptr);
  CHECK(api.set_workspace != nullptr);
  CHECK(api.gemm_ex_64 != nullptr);
  CHECK(api.sgemv_64 != nullptr);
  CHECK(api.sscal_64 != nullptr);
  REQUIRE(api.status_name != nullptr);
  CHECK(std::string(api.status_name(CUBLAS_STATUS_NOT_SUPPORTED)) == "CUBLAS_STATUS_NOT_SUPPORTED");
  CHECK(&cuda::cublas() == &api);  // opened once
}

TEST_CASE("cuDNN convolutions match the CPU kernels (heuristic algorithm choice)") {
  require_gpu();
  NumericsScope scope(exact_float32());
  uint32_t seed = 100;
  for (const ConvCase& k : conv_cases()) require_conv_matches_cpu(k, seed += 10);
}

TEST_CASE("cuDNN convolutions match the CPU kernels in benchmark mode") {
  require_gpu();
  NumericsScope scope(exact_float32(/*benchmark=*/true));
  uint32_t seed = 200;
  for (const ConvCase& k : conv_cases()) {
    // Twice: the first call times the algorithms, the second runs the cached choice.
    require_conv_matches_cpu(k, seed += 10);
    require_conv_matches_cpu(k, seed += 10);
  }
}

TEST_CASE("deterministic convolutions match the CPU kernels and repeat bitwise") {
  require_gpu();
  for (const bool benchmark : {false, true}) {
    INFO("benchmark: " << benchmark);
    NumericsScope scope(exact_float32(benchmark, /*deterministic=*/true));
    uint32_t seed = benchmark ? 400 : 300;
    for (const ConvCase& k : conv_cases()) {
      require_conv_matches_cpu(k, seed += 10);
      INFO("case: " << k.name);
      const ConvInputs in = conv_inputs(k, seed);
      const ConvOutputs first = run_conv(k, in, kGpu);
      for (int repeat = 0; repeat < 3; ++repeat) {
        const ConvOutputs again = run_conv(k, in, kGpu);
        CHECK(bitwise_equal(again.y, first.y));
        CHECK(bitwise_equal(again.dx, first.dx));
        CHECK(bitwise_equal(again.dw, first.dw));
        CHECK(bitwise_equal(again.db, first.db));
        CHECK(bitwise_equal(again.dw_acc, first.dw_acc));
        CHECK(bitwise_equal(again.db_acc, first.db_acc));
      }
    }
  }
}

// Note [Convolutions on the graph API] in tensor/cuda/cudnn_graph.cpp: the same calls, the
// same tolerances, with heuristics and benchmark mode, deterministic engines repeating
// bitwise; and every case did run there (a shape the graph API cannot take would fall
// back to the legacy API without telling the caller).
TEST_CASE("cuDNN's graph API runs the convolutions with the legacy API's results") {
  require_gpu();
  for (const bool benchmark : {false, true}) {
    for (const bool deterministic : {false, true}) {
      INFO("benchmark " << benchmark << ", deterministic " << deterministic);
      NumericsOptions o = exact_float32(benchmark, deterministic);
      o.cudnn_graph_api = true;
      NumericsScope scope(o);
      uint32_t seed = 800 + 100 * benchmark + 200 * deterministic;
      for (const ConvCase& k : conv_cases()) {
        const int64_t before = cuda::graph_convolutions_run();
        require_conv_matches_cpu(k, seed += 10);
        // Forward, data, and the weights twice (overwriting and accumulating).
        CHECK(cuda::graph_convolutions_run() - before == 4);
        if (!deterministic) continue;
        const ConvInputs in = conv_inputs(k, seed);
        const ConvOutputs first = run_conv(k, in, kGpu);
        const ConvOutputs again = run_conv(k, in, kGpu);
        CHECK(bitwise_equal(again.y, first.y));
        CHECK(bitwise_equal(again.dx, first.dx));
        CHECK(bitwise_equal(again.dw, first.dw));
        CHECK(bitwise_equal(again.dw_acc, first.dw_acc));
      }
    }
  }
  NumericsOptions tf32 = exact_float32();
  tf32.allow_tf32 = true;
  tf32.cudnn_graph_api = true;
  NumericsScope scope(tf32);
  uint32_t seed = 1200;
  // The TF32 bound of the legacy API's test below.
  for (const ConvCase& k : conv_cases()) require_conv_matches_cpu(k, seed += 10, 5e-2, 1e-2);
}

// Note [Channels last] in tensor/ops.h: NHWC activations, weights still [O, C, KH, KW],
// on both APIs, the same tolerances as NCHW.
TEST_CASE("channels-last convolutions match the CPU's NCHW results on both cuDNN APIs") {
  require_gpu();
  for (const bool graph : {false, true}) {
    for (const bool benchmark : {false, true}) {
      INFO("graph API " << graph << ", benchmark " << benchmark);
      NumericsOptions o = exact_float32(benchmark);
      o.cudnn_graph_api = graph;
      NumericsScope scope(o);
      uint32_t seed = 1400 + 100 * graph + 50 * benchmark;
      for (const ConvCase& k : conv_cases()) require_conv_matches_cpu(k, seed += 10, kAtol, kRtol, true);
    }
  }
}

TEST_CASE("convolutions with TF32 allowed stay within TF32 rounding of the CPU result") {
  require_gpu();
  NumericsOptions o = exact_float32();
  o.allow_tf32 = true;
  NumericsScope scope(o);
  // TF32 keeps 10 of float32's 23 mantissa bits, so each product is off by up to ~2^-10
  // relative; over K <= 400 terms with random signs that is ~sqrt(K) * 1e-3 = 2e-2 at
  // most. A wrong kernel is still off by whole terms (0.25 on average) in some element.
  uint32_t seed = 500;
  for (const ConvCase& k : conv_cases()) require_conv_matches_cpu(k, seed += 10, 5e-2, 1e-2);
}

TEST_CASE("empty batches on the GPU do what the CPU kernels do") {
  require_gpu();
  NumericsScope scope(exact_float32());
  const Conv2dParams p{1, 1, 1, 1};
  const Tensor x = Tensor::empty({0, 3, 6, 6}, DType::Float32, kGpu);
  const Tensor w = random_tensor({4, 3, 3, 3}, 7).to(kGpu);
  const Tensor dy = Tensor::empty({0, 4, 6, 6}, DType::Float32, kGpu);
  Tensor y = Tensor::empty({0, 4, 6, 6}, DType::Float32, kGpu);
  ops::conv2d_forward(x, w, Tensor(), y, p);
  Tensor dx = Tensor::empty({0, 3, 6, 6}, DType::Float32, kGpu);
  ops::conv2d_backward_data(dy, w, dx, p);
  Tensor dw = poisoned({4, 3, 3, 3}, kGpu);
  Tensor db = poisoned({4}, kGpu);
  ops::conv2d_backward_weights(x, dy, dw, db, p, /*accumulate=*/false);
  CHECK(host(dw).to_vector<float>() == std::vector<float>(static_cast<size_t>(dw.numel()), 0.0f));
  CHECK(host(db).to_vector<float>() == std::vector<float>(4, 0.0f));
  // Accumulating an empty batch leaves the gradients as they were.
  const Tensor dw0 = random_tensor({4, 3, 3, 3}, 8);
  Tensor dw_acc = dw0.to(kGpu);
  Tensor db_acc = Tensor::full({4}, 2.5f).to(kGpu);
  ops::conv2d_backward_weights(x, dy, dw_acc, db_acc, p, /*accumulate=*/true);
  CHECK(host(dw_acc).to_vector<float>() == dw0.to_vector<float>());
  CHECK(host(db_acc).to_vector<float>() == std::vector<float>(4, 2.5f));
}

TEST_CASE("cuBLAS matmul matches the CPU kernel in every transpose combination") {
  require_gpu();
  NumericsScope scope(exact_float32());
  const int64_t m = 5, n = 6, k = 7;
  uint32_t seed = 600;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      INFO("transpose_a " << ta << ", transpose_b " << tb);
      const Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, seed += 10);
      const Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, seed + 1);
      const Tensor c0 = random_tensor({m, n}, seed + 2);
      for (const auto& [alpha, beta] : {std::pair{1.0f, 0.0f}, std::pair{0.75f, -0.5f}}) {
        INFO("alpha " << alpha << ", beta " << beta);
        Tensor cpu = c0.clone();
        ops::matmul(a, ta, b, tb, cpu, alpha, beta);
        Tensor gpu = c0.to(kGpu);
        ops::matmul(a.to(kGpu), ta, b.to(kGpu), tb, gpu, alpha, beta);
        require_close(host(gpu), cpu, kAtol, kRtol);
      }
    }
  }
}

TEST_CASE("matmul with an empty inner dimension gives beta * c on the GPU") {
  require_gpu();
  NumericsScope scope(exact_float32());
  const Tensor a = Tensor::empty({3, 0}, DType::Float32, kGpu);
  const Tensor b = Tensor::empty({0, 4}, DType::Float32, kGpu);
  const Tensor c0 = random_tensor({3, 4}, 700);
  Tensor scaled = c0.to(kGpu);
  ops::matmul(a, false, b, false, scaled, 1.0f, -2.0f);
  Tensor expected = c0.clone();
  ops::matmul(Tensor::empty({3, 0}), false, Tensor::empty({0, 4}), false, expected, 1.0f, -2.0f);
  require_close(host(scaled), expected, 0.0, 0.0);
  // beta == 0 overwrites, NaN included.
  Tensor zeroed = poisoned({3, 4}, kGpu);
  ops::matmul(a, false, b, false, zeroed, 1.0f, 0.0f);
  CHECK(host(zeroed).to_vector<float>() == std::vector<float>(12, 0.0f));
}

TEST_CASE("cuBLAS linear forward and backward match the CPU kernels") {
  require_gpu();
  NumericsScope scope(exact_float32());
  const int64_t batch = 5, in = 7, out = 3;
  const Tensor x = random_tensor({batch, in}, 800);
  const Tensor w = random_tensor({out, in}, 801);
  const Tensor b = random_tensor({out}, 802);
  const Tensor dy = random_tensor({batch, out}, 803);
  const Tensor dw0 = random_tensor({out, in}, 804);
  const Tensor db0 = random_tensor({out}, 805);
  for (const bool with_bias : {false, true}) {
    for (const bool want_dx : {false, true}) {
      for (const bool accumulate : {false, true}) {
        INFO("bias " << with_bias << ", dx " << want_dx << ", accumulate " << accumulate);
        const LinearOutputs cpu =
            run_linear(x, w, b, dy, dw0, db0, with_bias, want_dx, accumulate, Device::cpu());
        const LinearOutputs gpu =
            run_linear(x, w, b, dy, dw0, db0, with_bias, want_dx, accumulate, kGpu);
        require_close(host(gpu.y), cpu.y, kAtol, kRtol);
        if (want_dx) require_close(host(gpu.dx), cpu.dx, kAtol, kRtol);
        require_close(host(gpu.dw), cpu.dw, kAtol, kRtol);
        if (with_bias) require_close(host(gpu.db), cpu.db, kAtol, kRtol);
      }
    }
  }
}

TEST_CASE("linear on an empty batch: nothing to add, overwritten gradients are zero") {
  require_gpu();
  NumericsScope scope(exact_float32());
  const Tensor x = Tensor::empty({0, 4}, DType::Float32, kGpu);
  const Tensor w = random_tensor({3, 4}, 900).to(kGpu);
  const Tensor dy = Tensor::empty({0, 3}, DType::Float32, kGpu);
  Tensor dx = Tensor::empty({0, 4}, DType::Float32, kGpu);
  Tensor dw = poisoned({3, 4}, kGpu);
  Tensor db = poisoned({3}, kGpu);
  ops::linear_backward(x, w, dy, dx, dw, db, /*accumulate=*/false);
  CHECK(host(dw).to_vector<float>() == std::vector<float>(12, 0.0f));
  CHECK(host(db).to_vector<float>() == std::vector<float>(3, 0.0f));
  Tensor db_acc = Tensor::full({3}, 1.5f).to(kGpu);
  Tensor dw_acc = Tensor::full({3, 4}, -1.0f).to(kGpu);
  ops::linear_backward(x, w, dy, dx, dw_acc, db_acc, /*accumulate=*/true);
  CHECK(host(dw_acc).to_vector<float>() == std::vector<float>(12, -1.0f));
  CHECK(host(db_acc).to_vector<float>() == std::vector<float>(3, 1.5f));
}

TEST_CASE("matmul with TF32 allowed stays within TF32 rounding of the CPU result") {
  require_gpu();
  NumericsOptions o = exact_float32();
  o.allow_tf32_matmul = true;
  NumericsScope scope(o);
  // K = 256 products each off by up to ~2^-10 relative, random signs: ~sqrt(K) * 1e-3.
  const Tensor a = random_tensor({64, 256}, 1000);
  const Tensor b = random_tensor({256, 48}, 1001);
  Tensor cpu = Tensor::empty({64, 48});
  ops::matmul(a, false, b, false, cpu);
  Tensor gpu = Tensor::empty({64, 48}, DType::Float32, kGpu);
  ops::matmul(a.to(kGpu), false, b.to(kGpu), false, gpu);
  require_close(host(gpu), cpu, 5e-2, 1e-2);
}

// The caller's stream is held at a gate while the library calls are queued: if cuDNN's
// or cuBLAS's handle stayed on another stream, their kernels would run at once and the
// poisoned outputs, read on a third stream before the gate opens, would have changed.
TEST_CASE("library calls queue on the caller's current stream") {
  require_gpu();
  NumericsScope scope(exact_float32());
  const ConvCase& k = conv_cases().front();
  const ConvInputs in = conv_inputs(k, 1100);
  const ConvOutputs cpu = run_conv(k, in, Device::cpu());
  const Tensor a = random_tensor({9, 11}, 1101), b = random_tensor({11, 13}, 1102);
  Tensor c_cpu = Tensor::empty({9, 13});
  ops::matmul(a, false, b, false, c_cpu);

  const Tensor x = in.x.to(kGpu), w = in.w.to(kGpu), bias = in.b.to(kGpu), dy = in.dy.to(kGpu);
  const Tensor ag = a.to(kGpu), bg = b.to(kGpu);
  Tensor y = poisoned(output_shape(k), kGpu), dw = poisoned(in.w.shape(), kGpu);
  Tensor db = poisoned({k.o}, kGpu), c = poisoned({9, 13}, kGpu);
  cuda::current_stream(0).synchronize();

  cuda::OwnedStream side(0);
  testing::StreamGate gate(side.stream().handle());
  {
    cuda::StreamGuard guard(side.stream());
    ops::conv2d_forward(x, w, bias, y, k.p);
    ops::conv2d_backward_weights(x, dy, dw, db, k.p, /*accumulate=*/false);
    ops::matmul(ag, false, bg, false, c);
  }
  const auto all_nan = [](const Tensor& t) {
    for (const float v : t.to_vector<float>()) {
      if (!std::isnan(v)) return false;
    }
    return true;
  };
  {
    cuda::OwnedStream reader(0);
    cuda::StreamGuard guard(reader.stream());
    CHECK(all_nan(y));
    CHECK(all_nan(dw));
    CHECK(all_nan(c));
  }
  gate.open();
  side.stream().synchronize();
  CHECK_FALSE(gate.timed_out());
  require_close(host(y), cpu.y, kAtol, kRtol);
  require_close(host(dw), cpu.dw, kAtol, kRtol);
  require_close(host(db), cpu.db, kAtol, kRtol);
  require_close(host(c), c_cpu, kAtol, kRtol);
}

// Note [16-bit kernels on the GPU]: cuDNN gets 16-bit x, w and dy and may round its
// partial results to 16 bits as well: the output before the bias is added, the partial
// sums of a split reduction. Each rounding moves a value by up to a relative 2^-8
// (bfloat16, 8 significant bits) or 2^-11 (float16, 11) of that partial result, which
// can be far larger than the element it ends in when terms cancel (on an H200 a
// bfloat16 output of 0.047 came out 0.00095 off, 2 %). So the reference is the CPU's
// float32 kernel on operands rounded the same way, and each element may differ by
// rtol = 2^-7 / 2^-10 of its magnitude: the same kernel over |x|, |w|, |dy| (plus |b|,
// |dw0|), which bounds every partial sum, with kAtol for the small sums. The bias
// gradient sums the float32 dy on both sides.
Tensor magnitude(const Tensor& t) {
  if (!t.defined()) return t;
  Tensor out = t.clone();
  for (float& v : std::span<float>(out.data<float>(), static_cast<size_t>(out.numel()))) v = std::fabs(v);
  return out;
}

void require_within_magnitude(const Tensor& actual, const Tensor& expected, const Tensor& scale,
                              double rtol) {
  REQUIRE(actual.shape() == expected.shape());
  REQUIRE(scale.shape() == expected.shape());
  const float* a = actual.data<float>();
  const float* e = expected.data<float>();
  const float* m = scale.data<float>();
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const double tol = kAtol + rtol * m[i];
    if (!(std::fabs(static_cast<double>(a[i]) - e[i]) <= tol)) {
      FAIL("element " << i << " of " << actual.str() << ": got " << a[i] << ", expected " << e[i]
                      << " (magnitude " << m[i] << ", tolerance " << tol << ")");
    }
  }
}

TEST_CASE("16-bit convolutions on cuDNN match the CPU's float32 kernels on rounded operands") {
  require_gpu();
  NumericsScope scope(exact_float32());
  for (const DType t : {DType::BFloat16, DType::Float16}) {
    INFO("compute " << dtype_name(t));
    if (!cuda_ops::compute_dtype_supported(t, kGpu)) {
      WARN("skipped " << dtype_name(t) << ": this GPU does not compute in it");
      continue;
    }
    const double rtol = t == DType::BFloat16 ? 1.0 / 128 : 1.0 / 1024;
    uint32_t seed = t == DType::BFloat16 ? 1300 : 1400;
    for (const ConvCase& k : conv_cases()) {
      INFO("case: " << k.name);
      const ConvInputs in = conv_inputs(k, seed += 10);
      ConvInputs r = in;
      for (Tensor* operand : {&r.x, &r.w, &r.dy}) {
        Tensor rounded = Tensor::empty(operand->shape());
        ops::round_to_dtype(*operand, t, rounded);
        *operand = rounded;
      }
      ConvInputs a;
      a.x = magnitude(r.x), a.w = magnitude(r.w), a.b = magnitude(r.b), a.dy = magnitude(r.dy);
      a.dw0 = magnitude(r.dw0), a.db0 = magnitude(r.db0);
      ConvCase k16 = k;
      k16.p.compute = t;
      const ConvOutputs gpu = run_conv(k16, in, kGpu);
      const ConvOutputs cpu = run_conv(k, r, Device::cpu());
      const ConvOutputs scale = run_conv(k, a, Device::cpu());
      const ConvOutputs cpu_plain = run_conv(k, in, Device::cpu());
      require_within_magnitude(host(gpu.y), cpu.y, scale.y, rtol);
      require_within_magnitude(host(gpu.dx), cpu.dx, scale.dx, rtol);
      require_within_magnitude(host(gpu.dw), cpu.dw, scale.dw, rtol);
      require_within_magnitude(host(gpu.dw_acc), cpu.dw_acc, scale.dw_acc, rtol);
      require_close(host(gpu.db), cpu_plain.db, kAtol, kRtol);
      require_close(host(gpu.db_acc), cpu_plain.db_acc, kAtol, kRtol);
    }
  }
}

// Note [16-bit activations] in tensor/ops.h: x, y, dy and dx stored in 16 bits, with each
// compute type, NCHW and channels last, on the CUDA entries directly (whatever the
// dispatch does). The reference is the dispatcher's fallback: the same GPU convolutions on
// float32 copies of the same values in the same layout, their y and dx then rounded to 16
// bits. Both hand cuDNN the same operands in the compute type under one plan (its key has
// no storage type), so with deterministic algorithms the bits agree; otherwise a split
// reduction may add its partial results in another order, and the bound of the test above
// applies. Two paths differ by design:
//  - the bias with a 16-bit compute type: cuDNN's 16-bit output plus b in float32, rounded
//    again (as autocast). The fallback rounds the same way, so y is within one 16-bit ulp
//    of it, and equal bit for bit to cuDNN's bias-free output in the compute type plus b,
//    added and rounded on the host;
//  - the bias gradient of a 16-bit dy: summed in double on the GPU, in another order than
//    the fallback's cuDNN float32 sums (within kAtol, kRtol of them). Every sum of these
//    16-bit values (multiples of 2^-32 or coarser, a few hundred of them below 1) is exact
//    in double, so db is the exact sum rounded once, and db_acc float(db0 + sum) once.
namespace {

Tensor converted(const Tensor& t, DType to) {  // on the CPU
  Tensor out = Tensor::empty(t.shape(), to);
  ops::convert(host(t), out);
  return out;
}

// A host float32 NCHW tensor of 16-bit values as a 16-bit GPU activation in its layout.
Tensor activation16(const Tensor& nchw, DType storage, bool last) {
  return converted(last ? channels_last(nchw) : nchw, storage).to(kGpu);
}

// A 16-bit activation in its layout as a host float32 NCHW tensor of the same values.
Tensor nchw_float32(const Tensor& t, bool last) {
  const Tensor wide = converted(t, DType::Float32);
  return last ? channels_first(wide) : wide;
}

// Whether float32 tensors of `storage` values are at most one representable `storage`
// value apart in every element (their bit patterns, in sign-magnitude order).
bool within_one_ulp16(const Tensor& a, const Tensor& b, DType storage) {
  const Tensor ha = converted(a, storage), hb = converted(b, storage);
  if (ha.shape() != hb.shape()) return false;
  const auto* pa = static_cast<const uint16_t*>(ha.raw_data());
  const auto* pb = static_cast<const uint16_t*>(hb.raw_data());
  const auto ordered = [](uint16_t v) {
    return (v & 0x8000u) != 0 ? -static_cast<int32_t>(v & 0x7fffu) : static_cast<int32_t>(v);
  };
  for (int64_t i = 0; i < ha.numel(); ++i) {
    if (std::abs(ordered(pa[i]) - ordered(pb[i])) > 1) return false;
  }
  return true;
}

// y[n, o, h, w] + b[o] in float32 (host NCHW, 16-bit values), rounded to `storage` (and
// returned as float32 values): what the GPU adds to a 16-bit convolution output.
Tensor plus_bias_rounded(const Tensor& y, const Tensor& b, DType storage) {
  Tensor sum = host(y).clone();
  const Tensor hb = host(b);
  float* p = sum.data<float>();
  const float* pb = hb.data<float>();
  const int64_t channels = sum.size(1), area = sum.size(2) * sum.size(3);
  for (int64_t i = 0; i < sum.numel(); ++i) p[i] = p[i] + pb[(i / area) % channels];
  return converted(converted(sum, storage), DType::Float32);
}

// The bias gradients of a host NCHW dy: db = float(sum), db_acc = float(db0 + sum), each
// sum over n, h, w in double.
std::pair<Tensor, Tensor> bias_sums(const Tensor& dy, const Tensor& db0) {
  const int64_t n = dy.size(0), channels = dy.size(1), area = dy.size(2) * dy.size(3);
  Tensor db = Tensor::empty({channels}), db_acc = Tensor::empty({channels});
  const float* p = dy.data<float>();
  for (int64_t o = 0; o < channels; ++o) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < area; ++j) sum += p[(i * channels + o) * area + j];
    }
    db.data<float>()[o] = static_cast<float>(sum);
    db_acc.data<float>()[o] = static_cast<float>(static_cast<double>(db0.data<float>()[o]) + sum);
  }
  return {db, db_acc};
}

}  // namespace

TEST_CASE("convolutions on 16-bit activations equal the float32 ones rounded", "[cuda][storage16]") {
  require_gpu();
  struct Mode {
    bool deterministic, graph_api;
  };
  const auto wide = [](const Tensor& t) { return converted(t, DType::Float32); };
  for (const Mode mode : {Mode{true, false}, Mode{true, true}, Mode{false, false}}) {
    NumericsOptions o = exact_float32(/*benchmark=*/false, mode.deterministic);
    o.cudnn_graph_api = mode.graph_api;
    NumericsScope scope(o);
    for (const DType storage : {DType::BFloat16, DType::Float16}) {
      for (const DType compute : {DType::Float32, DType::BFloat16, DType::Float16}) {
        INFO("storage " << dtype_name(storage) << ", compute " << dtype_name(compute) << ", deterministic "
                        << mode.deterministic << ", graph API " << mode.graph_api);
        if (!cuda_ops::compute_dtype_supported(compute, kGpu) || !cuda_ops::compute_dtype_supported(storage, kGpu)) {
          continue;
        }
        const double rtol = storage == DType::BFloat16 || compute == DType::BFloat16 ? 1.0 / 128 : 1.0 / 1024;
        uint32_t seed = 1600;
        for (const ConvCase& k : conv_cases()) {
          ConvCase kc = k;
          kc.p.compute = compute;
          ConvInputs r = conv_inputs(k, seed += 10);
          r.x = wide(converted(r.x, storage));
          r.dy = wide(converted(r.dy, storage));
          const auto [exact_db, exact_db_acc] = bias_sums(r.dy, r.db0);
          const Tensor w = r.w.to(kGpu), b = k.bias ? r.b.to(kGpu) : Tensor();
          for (const bool last : {false, true}) {
            INFO("case: " << k.name << (last ? ", channels last" : ""));
            const ConvOutputs ref = last ? run_conv_channels_last(kc, r) : run_conv(kc, r, kGpu);
            Conv2dParams p = kc.p;
            p.channels_last = last;
            const Tensor x16 = activation16(r.x, storage, last), dy16 = activation16(r.dy, storage, last);
            ConvOutputs got;
            got.y = activation16(Tensor::full(output_shape(k), NAN), storage, last);
            cuda_ops::conv2d_forward(x16, w, b, got.y, p);
            got.dx = activation16(Tensor::full(r.x.shape(), NAN), storage, last);
            cuda_ops::conv2d_backward_data(dy16, w, got.dx, p);
            got.dw = poisoned(w.shape(), kGpu);
            got.db = poisoned({k.o}, kGpu);
            cuda_ops::conv2d_backward_weights(x16, dy16, got.dw, got.db, p, /*accumulate=*/false);
            got.dw_acc = r.dw0.to(kGpu);
            got.db_acc = r.db0.to(kGpu);
            cuda_ops::conv2d_backward_weights(x16, dy16, got.dw_acc, got.db_acc, p, /*accumulate=*/true);
            // NCHW float32 values of the 16-bit results and references.
            const Tensor got_y = nchw_float32(got.y, last), got_dx = nchw_float32(got.dx, last);
            const Tensor ref_y = wide(converted(ref.y, storage)), ref_dx = wide(converted(ref.dx, storage));
            {
              INFO("bias gradient");
              require_close(host(got.db), host(ref.db), kAtol, kRtol);
              require_close(host(got.db_acc), host(ref.db_acc), kAtol, kRtol);
              CHECK(bitwise_equal(got.db, exact_db));
              CHECK(bitwise_equal(got.db_acc, exact_db_acc));
            }
            const bool bias_rounds_twice = k.bias && compute != DType::Float32;
            if (mode.deterministic) {
              if (bias_rounds_twice) {
                // cuDNN's own 16-bit output: y in the compute type, which it writes itself.
                Tensor plain = activation16(Tensor::full(output_shape(k), NAN), compute, last);
                cuda_ops::conv2d_forward(x16, w, Tensor(), plain, p);
                CHECK(within_one_ulp16(got_y, ref_y, storage));
                CHECK(bitwise_equal(got_y, plus_bias_rounded(nchw_float32(plain, last), r.b, storage)));
              } else {
                CHECK(bitwise_equal(got_y, ref_y));
              }
              CHECK(bitwise_equal(got_dx, ref_dx));
              CHECK(bitwise_equal(got.dw, ref.dw));
              CHECK(bitwise_equal(got.dw_acc, ref.dw_acc));
              continue;
            }
            ConvInputs a;
            a.x = magnitude(r.x), a.w = magnitude(r.w), a.b = magnitude(r.b), a.dy = magnitude(r.dy);
            a.dw0 = magnitude(r.dw0), a.db0 = magnitude(r.db0);
            const ConvOutputs scale = run_conv(k, a, Device::cpu());
            require_within_magnitude(got_y, ref_y, scale.y, rtol);
            require_within_magnitude(got_dx, ref_dx, scale.dx, rtol);
            require_within_magnitude(host(got.dw), host(ref.dw), scale.dw, rtol);
            require_within_magnitude(host(got.dw_acc), host(ref.dw_acc), scale.dw_acc, rtol);
          }
        }
      }
    }
  }
}

TEST_CASE("16-bit linear layers on cuBLAS match the CPU's 16-bit linear layers") {
  require_gpu();
  NumericsScope scope(exact_float32());
  const Tensor x = random_tensor({9, 33}, 1500), w = random_tensor({13, 33}, 1501), b = random_tensor({13}, 1502);
  const Tensor dy = random_tensor({9, 13}, 1503);
  for (const DType t : {DType::BFloat16, DType::Float16}) {
    INFO("compute " << dtype_name(t));
    if (!cuda_ops::compute_dtype_supported(t, kGpu)) continue;
    LinearOutputs out[2];
    for (const Device device : {Device::cpu(), kGpu}) {
      LinearOutputs& o = out[device.is_cuda() ? 1 : 0];
      o.y = poisoned({9, 13}, device);
      ops::linear_forward(x.to(device), w.to(device), b.to(device), o.y, t);
      o.dx = poisoned({9, 33}, device);
      o.dw = Tensor::zeros({13, 33}).to(device);
      o.db = Tensor::zeros({13}).to(device);
      ops::linear_backward(x.to(device), w.to(device), dy.to(device), o.dx, o.dw, o.db, /*accumulate=*/true, t);
    }
    require_close(host(out[1].y), out[0].y, kAtol, kRtol);
    require_close(host(out[1].dx), out[0].dx, kAtol, kRtol);
    require_close(host(out[1].dw), out[0].dw, kAtol, kRtol);
    require_close(host(out[1].db), out[0].db, kAtol, kRtol);
  }
}

TEST_CASE("non_finite_check_and_unscale on the GPU scales and finds inf and NaN as on the CPU") {
  require_gpu();
  Tensor a = Tensor::from_vector<float>({2.0f, -4.0f, 3e38f}, {3}).to(kGpu);
  Tensor b = Tensor::from_vector<float>({8.0f, 0.0f}, {2}).to(kGpu);
  CHECK_FALSE(ops::non_finite_check_and_unscale({&a, &b}, 0.5f));
  CHECK(a.to_vector<float>() == std::vector<float>{1.0f, -2.0f, 1.5e38f});
  CHECK(b.to_vector<float>() == std::vector<float>{4.0f, 0.0f});
  for (const float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    Tensor big = Tensor::zeros({1 << 20}).to(kGpu);
    Tensor c = Tensor::from_vector<float>({1.0f, bad}, {2}).to(kGpu);
    CHECK(ops::non_finite_check_and_unscale({&big, &c}, 0.25f));
    CHECK(c.to_vector<float>()[0] == 0.25f);
  }
}

TEST_CASE("GPU kernels reject tensors on another device, naming the op") {
  require_gpu();
  const Tensor x = random_tensor({1, 2, 4, 4}, 1200).to(kGpu);
  const Tensor w_host = random_tensor({3, 2, 3, 3}, 1201);
  Tensor y = Tensor::empty({1, 3, 4, 4}, DType::Float32, kGpu);
  CHECK_THROWS_AS(ops::conv2d_forward(x, w_host, Tensor(), y, Conv2dParams{1, 1, 1, 1}),
                  InternalError);
  CHECK_THROWS_WITH(ops::conv2d_forward(x, w_host, Tensor(), y, Conv2dParams{1, 1, 1, 1}),
                    Catch::Contains("conv2d_forward") && Catch::Contains("w"));
  const Tensor a = random_tensor({2, 3}, 1202).to(kGpu);
  Tensor c = Tensor::empty({2, 2}, DType::Float32, kGpu);
  CHECK_THROWS_WITH(ops::matmul(a, false, random_tensor({3, 2}, 1203), false, c),
                    Catch::Contains("matmul") && Catch::Contains("b must be"));
}

#endif  // MTRAIN_HAVE_CUDA
