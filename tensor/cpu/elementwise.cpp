// Elementwise kernels: contiguous loops that the compiler vectorises, split across
// threads only for large tensors (see kParallelGrain).
#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "core/error.h"
#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/dnnl_support.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {

using cpu::check_float;
using cpu::check_float_shape;
using cpu::kParallelGrain;

namespace {

// Note [Sigmoid on oneDNN]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A plain loop over std::exp stays scalar (glibc only offers its vector expf to
// -ffast-math builds) and was an eighth of LeNet's single-thread step. oneDNN's JIT
// logistic kernel is vectorised and as accurate as expf for our purposes (a few ulp;
// the layer tests compare against the defining formula). One cached primitive per
// element count, like the convolutions (Note [Convolution primitive cache]): the
// entry's memory objects are rebound to each call's tensors under the entry's lock.
struct SigmoidEntry {
  std::mutex mu;
  dnnl::eltwise_forward primitive;
  dnnl::memory src, dst;
};

SigmoidEntry& sigmoid_entry(int64_t n) {
  static std::mutex mu;
  static std::unordered_map<int64_t, std::unique_ptr<SigmoidEntry>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[n];
  if (!slot) {
    using dnnl::memory;
    const memory::desc md({n}, memory::data_type::f32, memory::format_tag::x);
    const dnnl::eltwise_forward::desc desc(dnnl::prop_kind::forward_training, dnnl::algorithm::eltwise_logistic,
                                           md, 0.0f, 0.0f);
    auto e = std::make_unique<SigmoidEntry>();
    e->primitive = dnnl::eltwise_forward(dnnl::eltwise_forward::primitive_desc(desc, cpu::dnnl_engine()));
    e->src = memory(md, cpu::dnnl_engine(), DNNL_MEMORY_NONE);
    e->dst = memory(md, cpu::dnnl_engine(), DNNL_MEMORY_NONE);
    slot = std::move(e);
  }
  return *slot;
}

}  // namespace

void cpu::add(const Tensor& a, const Tensor& b, Tensor& out) {
  check_float("add", "a", a);
  check_float_shape("add", "b", b, a.shape());
  check_float_shape("add", "out", out, a.shape());
  cpu::use_configured_threads();
  // Aliasing is element-for-element (out[i] depends only on a[i], b[i]), so out may
  // be a or b; no __restrict__ here.
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* po = out.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for simd if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
}

void cpu::add_(Tensor& out, const Tensor& a, float alpha) {
  check_float("add_", "out", out);
  check_float_shape("add_", "a", a, out.shape());
  cpu::use_configured_threads();
  const float* pa = a.data<float>();
  float* po = out.data<float>();
  const int64_t n = out.numel();
#pragma omp parallel for simd if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) po[i] += alpha * pa[i];
}

void cpu::scale_(Tensor& x, float alpha) {
  check_float("scale_", "x", x);
  cpu::use_configured_threads();
  float* p = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for simd if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) p[i] *= alpha;
}

void cpu::relu_forward(const Tensor& x, Tensor& y) {
  check_float("relu_forward", "x", x);
  check_float_shape("relu_forward", "y", y, x.shape());
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for simd if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) py[i] = px[i] > 0.0f ? px[i] : 0.0f;
}

void cpu::relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_float("relu_backward", "y", y);
  check_float_shape("relu_backward", "dy", dy, y.shape());
  check_float_shape("relu_backward", "dx", dx, y.shape());
  cpu::use_configured_threads();
  const float* py = y.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  const int64_t n = y.numel();
  // Both loads are unconditional so the select vectorises; a load inside the
  // ternary kept the loop scalar and branchy (15x slower on random signs).
#pragma omp parallel for simd if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const float g = pdy[i];
    pdx[i] = py[i] > 0.0f ? g : 0.0f;
  }
}

void cpu::sigmoid_forward(const Tensor& x, Tensor& y) {
  check_float("sigmoid_forward", "x", x);
  check_float_shape("sigmoid_forward", "y", y, x.shape());
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  const int64_t n = x.numel();
  if (n == 0) return;
  SigmoidEntry& e = sigmoid_entry(n);
  std::lock_guard<std::mutex> lock(e.mu);
  e.src.set_data_handle(const_cast<float*>(px));
  e.dst.set_data_handle(py);
  dnnl::stream& s = cpu::dnnl_stream();
  e.primitive.execute(s, {{DNNL_ARG_SRC, e.src}, {DNNL_ARG_DST, e.dst}});
  s.wait();
}

void cpu::sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_float("sigmoid_backward", "y", y);
  check_float_shape("sigmoid_backward", "dy", dy, y.shape());
  check_float_shape("sigmoid_backward", "dx", dx, y.shape());
  cpu::use_configured_threads();
  const float* py = y.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  const int64_t n = y.numel();
#pragma omp parallel for simd if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) pdx[i] = pdy[i] * py[i] * (1.0f - py[i]);
}

namespace {

// y[i] = f(x[i]) and dx[i] = g(x[i], dy[i]) over contiguous float32 tensors of one shape.
template <class F>
void map_unary(const char* op, const Tensor& x, Tensor& y, F f) {
  check_float(op, "x", x);
  check_float_shape(op, "y", y, x.shape());
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for simd if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) py[i] = f(px[i]);
}

// out[i] = f(a[i], b[i]); out may be a or b (element i is read before it is written).
template <class F>
void map_binary(const char* op, const char* a_name, const Tensor& a, const char* b_name, const Tensor& b,
                const char* out_name, Tensor& out, F f) {
  check_float(op, a_name, a);
  check_float_shape(op, b_name, b, a.shape());
  check_float_shape(op, out_name, out, a.shape());
  cpu::use_configured_threads();
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* po = out.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for simd if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) po[i] = f(pa[i], pb[i]);
}

template <class G>
void map_backward(const char* op, const Tensor& x, const Tensor& dy, Tensor& dx, G g) {
  map_binary(op, "x", x, "dy", dy, "dx", dx, g);
}

}  // namespace

// PyTorch's CPU formulas (aten/src/ATen/native/cpu/Activation.cpp), in its order of operations.
void cpu::hardtanh_forward(const Tensor& x, float lo, float hi, Tensor& y) {
  map_unary("hardtanh_forward", x, y, [lo, hi](float v) { return std::min(std::max(v, lo), hi); });
}

void cpu::hardtanh_backward(const Tensor& x, const Tensor& dy, float lo, float hi, Tensor& dx) {
  map_backward("hardtanh_backward", x, dy, dx, [lo, hi](float v, float g) { return v > lo && v < hi ? g : 0.0f; });
}

void cpu::hardsigmoid_forward(const Tensor& x, Tensor& y) {
  map_unary("hardsigmoid_forward", x, y, [](float v) { return std::min(std::max(v + 3.0f, 0.0f), 6.0f) / 6.0f; });
}

void cpu::hardsigmoid_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  map_backward("hardsigmoid_backward", x, dy, dx,
               [](float v, float g) { return v > -3.0f && v < 3.0f ? g * (1.0f / 6.0f) : 0.0f; });
}

void cpu::hardswish_forward(const Tensor& x, Tensor& y) {
  map_unary("hardswish_forward", x, y, [](float v) { return v * std::min(std::max(v + 3.0f, 0.0f), 6.0f) / 6.0f; });
}

void cpu::hardswish_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  map_backward("hardswish_backward", x, dy, dx, [](float v, float g) {
    return v < -3.0f ? 0.0f : (v <= 3.0f ? g * (v / 3.0f + 0.5f) : g);
  });
}

void cpu::affine(const Tensor& x, float scale, float shift, Tensor& y) {
  map_unary("affine", x, y, [scale, shift](float v) { return v * scale + shift; });
}

void cpu::erf_forward(const Tensor& x, Tensor& y) {
  map_unary("erf_forward", x, y, [](float v) { return std::erf(v); });
}

void cpu::erf_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  constexpr float kTwoOverSqrtPi = 1.1283791670955126f;
  map_backward("erf_backward", x, dy, dx, [](float v, float g) { return g * kTwoOverSqrtPi * std::exp(-v * v); });
}

void cpu::mul(const Tensor& a, const Tensor& b, Tensor& out) {
  map_binary("mul", "a", a, "b", b, "out", out, [](float u, float v) { return u * v; });
}

void cpu::scale_channels(const Tensor& x, const Tensor& s, Tensor& y) {
  const ChannelPlanes g = channel_planes("scale_channels", x, s);
  check_float_shape("scale_channels", "y", y, x.shape());
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  const float* ps = s.data<float>();
  float* py = y.data<float>();
#pragma omp parallel for if (g.planes * g.inner >= kParallelGrain)
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    const float scale = ps[plane % g.values];
    const float* row = px + plane * g.inner;
    float* out = py + plane * g.inner;
#pragma omp simd
    for (int64_t i = 0; i < g.inner; ++i) out[i] = row[i] * scale;
  }
}

void cpu::channel_dot(const Tensor& a, const Tensor& b, Tensor& out) {
  const ChannelPlanes g = channel_planes("channel_dot", a, out);
  check_float_shape("channel_dot", "b", b, a.shape());
  cpu::use_configured_threads();
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* po = out.data<float>();
  // Value v sums planes v, v + values, ... (one plane, or a channel of every image).
#pragma omp parallel for if (g.planes * g.inner >= kParallelGrain)
  for (int64_t v = 0; v < g.values; ++v) {
    double sum = 0.0;  // a plane is a whole feature map: summed in double, as the GPU does
    for (int64_t plane = v; plane < g.planes; plane += g.values) {
      const float* ra = pa + plane * g.inner;
      const float* rb = pb + plane * g.inner;
      for (int64_t i = 0; i < g.inner; ++i) sum += static_cast<double>(ra[i]) * rb[i];
    }
    po[v] = static_cast<float>(sum);
  }
}

void cpu::dropout_mask(Tensor& mask, float p, uint64_t seed) {
  check_float("dropout_mask", "mask", mask);
  MTRAIN_CHECK(p >= 0.0f && p < 1.0f, "dropout_mask: p must be in [0, 1), found {}", p);
  cpu::use_configured_threads();
  float* pm = mask.data<float>();
  const float kept = 1.0f / (1.0f - p);
  const int64_t n = mask.numel();
#pragma omp parallel for if (n >= kParallelGrain)
  for (int64_t i = 0; i < n; ++i) pm[i] = dropout_uniform(seed, static_cast<uint64_t>(i)) >= p ? kept : 0.0f;
}

}  // namespace mtrain::ops
