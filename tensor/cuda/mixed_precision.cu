// The GPU side of Note [Reduced-precision compute] (tensor/ops.h) and of loss scaling:
// conversions between float32 and the 16-bit types, the multi-tensor non-finite check,
// and which 16-bit types a GPU computes in (Note [16-bit kernels on the GPU] in
// tensor/cuda_ops.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/mixed_precision.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::kThreads;

// Round to nearest even, as the CPU's round_to_dtype (__float2bfloat16 and
// __float2half are _rn conversions).
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half(v);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <class T>
__global__ void narrow_kernel(const float* src, T* dst, int64_t n) {
  for (int64_t i = detail::global_thread_index(); i < n; i += detail::grid_stride()) {
    dst[i] = from_float<T>(src[i]);
  }
}

template <class T>
__global__ void widen_kernel(const T* src, float* dst, int64_t n, bool accumulate) {
  for (int64_t i = detail::global_thread_index(); i < n; i += detail::grid_stride()) {
    const float v = to_float(src[i]);
    dst[i] = accumulate ? __fadd_rn(dst[i], v) : v;
  }
}

// Sets *found when any element is not finite, and scales every element.
__global__ void unscale_kernel(float* g, int64_t n, float inv_scale, int* found) {
  bool bad = false;
  for (int64_t i = detail::global_thread_index(); i < n; i += detail::grid_stride()) {
    const float v = g[i];
    if (!isfinite(v)) bad = true;
    g[i] = __fmul_rn(v, inv_scale);
  }
  if (bad) *found = 1;  // a benign race: every writer stores 1
}

}  // namespace

namespace detail {

Tensor narrowed(const Tensor& x, DType compute) {
  MTRAIN_CHECK(x.defined() && x.device().is_cuda() && x.dtype() == DType::Float32,
               "narrowed: expected a float32 GPU tensor, found {}", x.defined() ? x.str() : "undefined");
  MTRAIN_CHECK(compute == DType::BFloat16 || compute == DType::Float16, "narrowed: no 16-bit type {}",
               dtype_name(compute));
  Tensor out = Tensor::empty(x.shape(), compute, x.device());
  const int64_t n = x.numel();
  if (n == 0) return out;
  const cudaStream_t stream = stream_for(x.device().index);
  if (compute == DType::BFloat16) {
    narrow_kernel<<<grid_for(n), kThreads, 0, stream>>>(x.data<float>(),
                                                        static_cast<__nv_bfloat16*>(out.raw_data()), n);
  } else {
    narrow_kernel<<<grid_for(n), kThreads, 0, stream>>>(x.data<float>(), static_cast<__half*>(out.raw_data()), n);
  }
  MTRAIN_CUDA_CHECK(cudaGetLastError());
  return out;
}

void widen_into(const Tensor& src, Tensor& dst, bool accumulate) {
  MTRAIN_CHECK(src.defined() && dst.defined() && src.device() == dst.device() && src.numel() == dst.numel() &&
                   dst.dtype() == DType::Float32 &&
                   (src.dtype() == DType::BFloat16 || src.dtype() == DType::Float16),
               "widen_into: expected a 16-bit source and a float32 destination of equal size on one GPU, found "
               "{} and {}", src.defined() ? src.str() : "undefined", dst.defined() ? dst.str() : "undefined");
  const int64_t n = src.numel();
  if (n == 0) return;
  const cudaStream_t stream = stream_for(src.device().index);
  if (src.dtype() == DType::BFloat16) {
    widen_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(src.raw_data()),
                                                       dst.data<float>(), n, accumulate);
  } else {
    widen_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<const __half*>(src.raw_data()),
                                                       dst.data<float>(), n, accumulate);
  }
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void convert_between(const Tensor& src, Tensor& dst) {
  MTRAIN_CHECK(src.defined() && dst.defined() && src.device() == dst.device() && src.device().is_cuda() &&
                   src.numel() == dst.numel() && is_floating(src.dtype()) &&
                   is_floating(dst.dtype()),
               "convert_between: expected two float32 / bfloat16 / float16 tensors of equal size on one GPU, "
               "found {} and {}", src.defined() ? src.str() : "undefined", dst.defined() ? dst.str() : "undefined");
  cuda::DeviceGuard guard(src.device().index);
  if (src.dtype() == dst.dtype()) {
    dst.copy_(src);
  } else if (src.dtype() == DType::Float32 || dst.dtype() == DType::Float32) {
    convert(src, dst);
  } else {
    Tensor wide = Tensor::empty(src.shape(), DType::Float32, src.device());
    widen_into(src, wide, /*accumulate=*/false);
    convert(wide, dst);
  }
}

Tensor in_dtype(const Tensor& t, DType to) {
  if (t.dtype() == to) return t;
  Tensor out = Tensor::empty(t.shape(), to, t.device());
  convert_between(t, out);
  return out;
}

}  // namespace detail

void convert(const Tensor& src, Tensor& dst) {
  MTRAIN_CHECK(src.defined() && dst.defined() && src.device() == dst.device() && src.numel() == dst.numel(),
               "convert: expected two tensors of equal size on one GPU, found {} and {}",
               src.defined() ? src.str() : "undefined", dst.defined() ? dst.str() : "undefined");
  cuda::DeviceGuard guard(src.device().index);
  if (src.dtype() == DType::Float32 && (dst.dtype() == DType::BFloat16 || dst.dtype() == DType::Float16)) {
    const int64_t n = src.numel();
    if (n == 0) return;
    const cudaStream_t stream = detail::stream_for(src.device().index);
    if (dst.dtype() == DType::BFloat16) {
      narrow_kernel<<<detail::grid_for(n), kThreads, 0, stream>>>(src.data<float>(),
                                                                  static_cast<__nv_bfloat16*>(dst.raw_data()), n);
    } else {
      narrow_kernel<<<detail::grid_for(n), kThreads, 0, stream>>>(src.data<float>(),
                                                                  static_cast<__half*>(dst.raw_data()), n);
    }
    MTRAIN_CUDA_CHECK(cudaGetLastError());
    return;
  }
  detail::widen_into(src, dst, /*accumulate=*/false);  // checks the other direction
}

bool compute_dtype_supported(DType compute, Device device) {
  if (compute == DType::Float32) return true;
  if (compute != DType::BFloat16 && compute != DType::Float16) return false;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error; the answer is "no"
    return false;
  }
  return compute == DType::BFloat16 ? major >= 8 : major >= 7;
}

bool non_finite_check_and_unscale(const std::vector<Tensor*>& grads, float inv_scale) {
  const char* op = "non_finite_check_and_unscale";
  MTRAIN_CHECK(!grads.empty() && grads[0] != nullptr, "{}: no gradients", op);
  const Device device = detail::first_gpu(op, "grad 0", *grads[0]);
  cuda::DeviceGuard guard(device.index);
  const cudaStream_t stream = detail::stream_for(device.index);
  Tensor flag = Tensor::zeros({1}, DType::Int32, device);
  int* found = static_cast<int*>(flag.raw_data());
  for (size_t i = 0; i < grads.size(); ++i) {
    MTRAIN_CHECK(grads[i] != nullptr, "{}: gradient {} is null", op, i);
    detail::check_on(op, "grad", *grads[i], device);
    const int64_t n = grads[i]->numel();
    if (n == 0) continue;
    unscale_kernel<<<detail::grid_for(n), kThreads, 0, stream>>>(grads[i]->data<float>(), n, inv_scale, found);
    MTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  int host = 0;
  MTRAIN_CUDA_CHECK(cudaMemcpyAsync(&host, found, sizeof host, cudaMemcpyDeviceToHost, stream));
  MTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host != 0;
}

}  // namespace mtrain::cuda_ops
