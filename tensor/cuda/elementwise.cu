// Elementwise kernels on the GPU: the counterparts of tensor/cpu/elementwise.cpp (Note
// [Kernel dispatch] in tensor/ops.cpp). One grid-stride kernel template applies a
// per-element functor; it moves four floats per load and store (float4) when every
// pointer is 16-byte aligned, which tensors fresh from the allocator are and views at
// odd offsets may not be. add, add_, relu_forward and relu_backward also take 16-bit
// activations (Note [16-bit activations] in tensor/ops.h): map16_kernel loads each element
// as float, applies the same functor, and rounds once to the storage type. A
// convolution's bias on 16-bit activations is added here too (detail::add_channel_bias).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/mixed_precision.h"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"
#include "tensor/ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_on_shape;
using detail::first_gpu;
using detail::kThreads;

// out[i] = op(a[i]) or op(a[i], b[i]). No __restrict__: out may be a or b (ops.h allows
// it), which is safe because element i is read before it is written by the same thread.
template <int kInputs, class Op>
__global__ void map_kernel(Op op, const float* a, const float* b, float* out, int64_t n,
                           bool vectorized) {
  const int64_t start = detail::global_thread_index();
  const int64_t stride = detail::grid_stride();
  int64_t scalar_from = 0;
  if (vectorized) {
    const int64_t n4 = n / 4;
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    float4* out4 = reinterpret_cast<float4*>(out);
    for (int64_t i = start; i < n4; i += stride) {
      const float4 va = a4[i];
      float4 r;
      if constexpr (kInputs == 2) {
        const float4 vb = b4[i];
        r = make_float4(op(va.x, vb.x), op(va.y, vb.y), op(va.z, vb.z), op(va.w, vb.w));
      } else {
        r = make_float4(op(va.x), op(va.y), op(va.z), op(va.w));
      }
      out4[i] = r;
    }
    scalar_from = n4 * 4;
  }
  for (int64_t i = scalar_from + start; i < n; i += stride) {
    if constexpr (kInputs == 2) {
      out[i] = op(a[i], b[i]);
    } else {
      out[i] = op(a[i]);
    }
  }
}

template <int kInputs, class Op>
void launch_map(Device device, Op op, const float* a, const float* b, float* out, int64_t n) {
  if (n == 0) return;
  cuda::DeviceGuard guard(device.index);
  const bool vectorized =
      detail::aligned16(a) && (kInputs == 1 || detail::aligned16(b)) && detail::aligned16(out);
  const int64_t items = vectorized ? (n + 3) / 4 : n;
  map_kernel<kInputs><<<detail::grid_for(items), kThreads, 0, detail::stream_for(device.index)>>>(
      op, a, b, out, n, vectorized);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

// map_kernel for 16-bit storage T (__nv_bfloat16 or __half): a scalar grid-stride loop,
// each element widened to float, `op` applied in float, the result rounded to T once.
template <int kInputs, class T, class Op>
__global__ void map16_kernel(Op op, const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = detail::global_thread_index(); i < n; i += detail::grid_stride()) {
    if constexpr (kInputs == 2) {
      out[i] = detail::store_as<T>(op(detail::load_float(a[i]), detail::load_float(b[i])));
    } else {
      out[i] = detail::store_as<T>(op(detail::load_float(a[i])));
    }
  }
}

// out = op(a[, b]) over tensors of one activation dtype `dtype` (checked by the caller):
// launch_map for float32, map16_kernel for the 16-bit types.
template <int kInputs, class Op>
void map_activations(Device device, DType dtype, Op op, const Tensor& a, const Tensor* b, Tensor& out) {
  const int64_t n = out.numel();
  if (dtype == DType::Float32) {
    launch_map<kInputs>(device, op, a.data<float>(), b != nullptr ? b->data<float>() : nullptr,
                        out.data<float>(), n);
    return;
  }
  if (n == 0) return;
  cuda::DeviceGuard guard(device.index);
  detail::with_storage(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, float>) {
      map16_kernel<kInputs><<<detail::grid_for(n), kThreads, 0, detail::stream_for(device.index)>>>(
          op, detail::storage_data<T>(a), b != nullptr ? detail::storage_data<T>(*b) : nullptr,
          detail::storage_data<T>(out), n);
    }
  });
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

// The formulas of tensor/cpu/elementwise.cpp, rounded as there (Note [Unfused float
// arithmetic] in tensor/cuda/launch.cuh).
struct Add {
  __device__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};
struct AddScaled {
  float alpha;
  __device__ float operator()(float out, float a) const {
    return __fadd_rn(out, __fmul_rn(alpha, a));
  }
};
struct Scale {
  float alpha;
  __device__ float operator()(float x) const { return __fmul_rn(x, alpha); }
};
// A NaN input gives 0, as the CPU's `x > 0 ? x : 0`.
struct Relu {
  __device__ float operator()(float x) const { return x > 0.0f ? x : 0.0f; }
};
struct ReluBackward {
  __device__ float operator()(float y, float dy) const { return y > 0.0f ? dy : 0.0f; }
};
// expf (not the fast __expf) keeps the result within a few ulp of the CPU's oneDNN
// logistic; exp(-x) overflowing to inf gives exactly 0, as it should.
struct Sigmoid {
  __device__ float operator()(float x) const { return 1.0f / (1.0f + expf(-x)); }
};
struct SigmoidBackward {
  __device__ float operator()(float y, float dy) const {
    return __fmul_rn(__fmul_rn(dy, y), __fsub_rn(1.0f, y));
  }
};

struct Mul {
  __device__ float operator()(float a, float b) const { return __fmul_rn(a, b); }
};

// y = x * s[plane % values]: one thread per element, the plane from the index.
__global__ void scale_channels_kernel(const float* x, const float* s, float* y, int64_t n, int64_t inner,
                                      int64_t values) {
  for (int64_t i = detail::global_thread_index(); i < n; i += detail::grid_stride()) {
    y[i] = __fmul_rn(x[i], s[i / inner % values]);
  }
}

// One block per value, over planes v, v + values, ...: the products summed in double in a
// fixed tree order.
__global__ void channel_dot_kernel(const float* a, const float* b, float* out, int64_t inner, int64_t planes,
                                   int64_t values) {
  __shared__ double shared[kThreads / 32];
  const int64_t v = blockIdx.x;
  double sum = 0.0;
  for (int64_t plane = v; plane < planes; plane += values) {
    const float* ra = a + plane * inner;
    const float* rb = b + plane * inner;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) sum += static_cast<double>(ra[i]) * rb[i];
  }
  sum = detail::block_sum(sum, shared);
  if (threadIdx.x == 0) out[v] = static_cast<float>(sum);
}

// A convolution's bias (detail::add_channel_bias): y[i] = src[i] + b[(i / area) % c] in
// float32, rounded once to T; area 1 for channels last, whose channel is the innermost
// index. No __restrict__: src may be y, and element i is read before the same thread
// writes it.
template <class S, class T, class Index>
__global__ void channel_bias_kernel(const S* src, const float* b, T* y, Index n, Index c, Index area) {
  for (Index i = static_cast<Index>(detail::global_thread_index()); i < n;
       i += static_cast<Index>(detail::grid_stride())) {
    y[i] = detail::store_as<T>(__fadd_rn(detail::load_float(src[i]), b[(i / area) % c]));
  }
}

__global__ void dropout_mask_kernel(float* mask, int64_t n, float p, float kept, uint64_t seed) {
  for (int64_t i = detail::global_thread_index(); i < n; i += detail::grid_stride()) {
    mask[i] = ops::dropout_uniform(seed, static_cast<uint64_t>(i)) >= p ? kept : 0.0f;
  }
}

// PyTorch's formulas, as tensor/cpu/elementwise.cpp computes them; clamp is its
// std::min(std::max(x, lo), hi), which keeps a NaN (fminf and fmaxf would drop it).
__device__ inline float clamp(float x, float lo, float hi) {
  const float t = x < lo ? lo : x;
  return hi < t ? hi : t;
}
struct Hardtanh {
  float lo, hi;
  __device__ float operator()(float x) const { return clamp(x, lo, hi); }
};
struct HardtanhBackward {
  float lo, hi;
  __device__ float operator()(float x, float dy) const { return x > lo && x < hi ? dy : 0.0f; }
};
struct Hardsigmoid {
  __device__ float operator()(float x) const { return __fdiv_rn(clamp(__fadd_rn(x, 3.0f), 0.0f, 6.0f), 6.0f); }
};
struct HardsigmoidBackward {
  __device__ float operator()(float x, float dy) const {
    return x > -3.0f && x < 3.0f ? __fmul_rn(dy, 1.0f / 6.0f) : 0.0f;
  }
};
struct Hardswish {
  __device__ float operator()(float x) const {
    return __fdiv_rn(__fmul_rn(x, clamp(__fadd_rn(x, 3.0f), 0.0f, 6.0f)), 6.0f);
  }
};
struct Affine {
  float scale, shift;
  __device__ float operator()(float x) const { return __fadd_rn(__fmul_rn(x, scale), shift); }
};
struct Erf {
  __device__ float operator()(float x) const { return erff(x); }
};
struct ErfBackward {
  __device__ float operator()(float x, float dy) const {
    return __fmul_rn(__fmul_rn(dy, 1.1283791670955126f), expf(-__fmul_rn(x, x)));
  }
};
struct HardswishBackward {
  __device__ float operator()(float x, float dy) const {
    return x < -3.0f ? 0.0f : (x <= 3.0f ? __fmul_rn(dy, __fadd_rn(__fdiv_rn(x, 3.0f), 0.5f)) : dy);
  }
};

}  // namespace

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const DType t = detail::activation_dtype("add", {{"a", &a}, {"b", &b}, {"out", &out}});
  const Device device = first_gpu("add", "a", a, t);
  check_on_shape("add", "b", b, device, a.shape(), t);
  check_on_shape("add", "out", out, device, a.shape(), t);
  map_activations<2>(device, t, Add{}, a, &b, out);
}

void add_(Tensor& out, const Tensor& a, float alpha) {
  const DType t = detail::activation_dtype("add_", {{"out", &out}, {"a", &a}});
  const Device device = first_gpu("add_", "out", out, t);
  check_on_shape("add_", "a", a, device, out.shape(), t);
  map_activations<2>(device, t, AddScaled{alpha}, out, &a, out);
}

void scale_(Tensor& x, float alpha) {
  const Device device = first_gpu("scale_", "x", x);
  float* p = x.data<float>();
  launch_map<1>(device, Scale{alpha}, p, nullptr, p, x.numel());
}

void relu_forward(const Tensor& x, Tensor& y) {
  const DType t = detail::activation_dtype("relu_forward", {{"x", &x}, {"y", &y}});
  const Device device = first_gpu("relu_forward", "x", x, t);
  check_on_shape("relu_forward", "y", y, device, x.shape(), t);
  map_activations<1>(device, t, Relu{}, x, nullptr, y);
}

void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const DType t = detail::activation_dtype("relu_backward", {{"y", &y}, {"dy", &dy}, {"dx", &dx}});
  const Device device = first_gpu("relu_backward", "y", y, t);
  check_on_shape("relu_backward", "dy", dy, device, y.shape(), t);
  check_on_shape("relu_backward", "dx", dx, device, y.shape(), t);
  map_activations<2>(device, t, ReluBackward{}, y, &dy, dx);
}

void sigmoid_forward(const Tensor& x, Tensor& y) {
  const Device device = first_gpu("sigmoid_forward", "x", x);
  check_on_shape("sigmoid_forward", "y", y, device, x.shape());
  launch_map<1>(device, Sigmoid{}, x.data<float>(), nullptr, y.data<float>(), x.numel());
}

void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const Device device = first_gpu("sigmoid_backward", "y", y);
  check_on_shape("sigmoid_backward", "dy", dy, device, y.shape());
  check_on_shape("sigmoid_backward", "dx", dx, device, y.shape());
  launch_map<2>(device, SigmoidBackward{}, y.data<float>(), dy.data<float>(), dx.data<float>(),
                y.numel());
}

namespace {

template <class Op>
void unary(const char* name, const Tensor& x, Tensor& y, Op op) {
  const Device device = first_gpu(name, "x", x);
  check_on_shape(name, "y", y, device, x.shape());
  launch_map<1>(device, op, x.data<float>(), nullptr, y.data<float>(), x.numel());
}

template <class Op>
void backward(const char* name, const Tensor& x, const Tensor& dy, Tensor& dx, Op op) {
  const Device device = first_gpu(name, "x", x);
  check_on_shape(name, "dy", dy, device, x.shape());
  check_on_shape(name, "dx", dx, device, x.shape());
  launch_map<2>(device, op, x.data<float>(), dy.data<float>(), dx.data<float>(), x.numel());
}

}  // namespace

void hardtanh_forward(const Tensor& x, float lo, float hi, Tensor& y) { unary("hardtanh_forward", x, y, Hardtanh{lo, hi}); }
void hardtanh_backward(const Tensor& x, const Tensor& dy, float lo, float hi, Tensor& dx) {
  backward("hardtanh_backward", x, dy, dx, HardtanhBackward{lo, hi});
}
void hardsigmoid_forward(const Tensor& x, Tensor& y) { unary("hardsigmoid_forward", x, y, Hardsigmoid{}); }
void hardsigmoid_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  backward("hardsigmoid_backward", x, dy, dx, HardsigmoidBackward{});
}
void hardswish_forward(const Tensor& x, Tensor& y) { unary("hardswish_forward", x, y, Hardswish{}); }
void hardswish_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  backward("hardswish_backward", x, dy, dx, HardswishBackward{});
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  const Device device = first_gpu("mul", "a", a);
  check_on_shape("mul", "b", b, device, a.shape());
  check_on_shape("mul", "out", out, device, a.shape());
  launch_map<2>(device, Mul{}, a.data<float>(), b.data<float>(), out.data<float>(), a.numel());
}

void affine(const Tensor& x, float scale, float shift, Tensor& y) {
  const Device device = first_gpu("affine", "x", x);
  check_on_shape("affine", "y", y, device, x.shape());
  launch_map<1>(device, Affine{scale, shift}, x.data<float>(), nullptr, y.data<float>(), x.numel());
}

void erf_forward(const Tensor& x, Tensor& y) {
  const Device device = first_gpu("erf_forward", "x", x);
  check_on_shape("erf_forward", "y", y, device, x.shape());
  launch_map<1>(device, Erf{}, x.data<float>(), nullptr, y.data<float>(), x.numel());
}

void erf_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  const Device device = first_gpu("erf_backward", "x", x);
  check_on_shape("erf_backward", "dy", dy, device, x.shape());
  check_on_shape("erf_backward", "dx", dx, device, x.shape());
  launch_map<2>(device, ErfBackward{}, x.data<float>(), dy.data<float>(), dx.data<float>(), x.numel());
}

void scale_channels(const Tensor& x, const Tensor& s, Tensor& y) {
  const Device device = first_gpu("scale_channels", "x", x);
  const ops::ChannelPlanes g = ops::channel_planes("scale_channels", x, s);
  check_on_shape("scale_channels", "y", y, device, x.shape());
  const int64_t n = x.numel();
  if (n == 0) return;
  cuda::DeviceGuard guard(device.index);
  scale_channels_kernel<<<detail::grid_for(n), kThreads, 0, detail::stream_for(device.index)>>>(
      x.data<float>(), s.data<float>(), y.data<float>(), n, g.inner, g.values);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void channel_dot(const Tensor& a, const Tensor& b, Tensor& out) {
  const Device device = first_gpu("channel_dot", "a", a);
  const ops::ChannelPlanes g = ops::channel_planes("channel_dot", a, out);
  check_on_shape("channel_dot", "b", b, device, a.shape());
  if (g.values == 0) return;
  cuda::DeviceGuard guard(device.index);
  MTRAIN_CHECK(g.values <= INT32_MAX, "channel_dot: {} sums are more than one grid holds", g.values);
  channel_dot_kernel<<<static_cast<unsigned>(g.values), kThreads, 0, detail::stream_for(device.index)>>>(
      a.data<float>(), b.data<float>(), out.data<float>(), g.inner, g.planes, g.values);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

namespace detail {

void add_channel_bias(const Tensor& src, const Tensor& b, bool channels_last, Tensor& y) {
  const char* op = "add_channel_bias";
  MTRAIN_CHECK(y.defined() && is_floating(y.dtype()) && src.defined() && is_floating(src.dtype()),
               "{}: src and y must be float32, bfloat16 or float16 tensors, found {} and {}", op,
               src.defined() ? src.str() : "undefined", y.defined() ? y.str() : "undefined");
  const Device device = first_gpu(op, "y", y, y.dtype());
  check_ndim(op, "y", y, 4);
  check_on_shape(op, "src", src, device, y.shape(), src.dtype());
  const int64_t c = channels_last ? y.size(3) : y.size(1);
  const int64_t area = channels_last ? 1 : y.size(2) * y.size(3);
  check_on_shape(op, "b", b, device, {c});
  const int64_t n = y.numel();
  if (n == 0) return;
  cuda::DeviceGuard guard(device.index);
  const unsigned grid = grid_for(n);
  const cudaStream_t stream = stream_for(device.index);
  // 32-bit indices when every index the grid-stride loop forms fits (the division is cheaper).
  const bool narrow_index = n + static_cast<int64_t>(grid) * kThreads <= static_cast<int64_t>(UINT32_MAX);
  with_storage(src.dtype(), [&](auto source_tag) {
    using S = typename decltype(source_tag)::type;
    with_storage(y.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      const S* ps = storage_data<S>(src);
      T* py = storage_data<T>(y);
      if (narrow_index) {
        channel_bias_kernel<<<grid, kThreads, 0, stream>>>(ps, b.data<float>(), py, static_cast<uint32_t>(n),
                                                           static_cast<uint32_t>(c), static_cast<uint32_t>(area));
      } else {
        channel_bias_kernel<<<grid, kThreads, 0, stream>>>(ps, b.data<float>(), py, n, c, area);
      }
    });
  });
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace detail

void dropout_mask(Tensor& mask, float p, uint64_t seed) {
  const Device device = first_gpu("dropout_mask", "mask", mask);
  MTRAIN_CHECK(p >= 0.0f && p < 1.0f, "dropout_mask: p must be in [0, 1), found {}", p);
  const int64_t n = mask.numel();
  if (n == 0) return;
  cuda::DeviceGuard guard(device.index);
  dropout_mask_kernel<<<detail::grid_for(n), kThreads, 0, detail::stream_for(device.index)>>>(
      mask.data<float>(), n, p, 1.0f / (1.0f - p), seed);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mtrain::cuda_ops
