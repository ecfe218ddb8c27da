// Conversions between float32 and the 16-bit compute types on a GPU, for the cuDNN and
// cuBLAS kernels (Note [16-bit kernels on the GPU] in tensor/cuda_ops.h), and the storage
// types of 16-bit activations (Note [16-bit activations] in tensor/ops.h). Internal to
// tensor/cuda/.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include "core/error.h"
#include "tensor/tensor.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace mtrain::cuda_ops::detail {

// A new `compute` (BFloat16 or Float16) tensor holding contiguous float32 `x` rounded to
// nearest even, from the caching allocator; queued on the current stream.
Tensor narrowed(const Tensor& x, DType compute);
// dst (+)= float32(src), elementwise; src 16-bit, dst float32 of the same size.
void widen_into(const Tensor& src, Tensor& dst, bool accumulate);

// dst = src between any two of float32, bfloat16 and float16 (between the two 16-bit types
// through a float32 temporary, which rounds once: every 16-bit value is a float32), same
// size, one GPU; a copy when the dtypes agree.
void convert_between(const Tensor& src, Tensor& dst);
// `t` itself when it is already of dtype `to`, else a new converted copy of it.
Tensor in_dtype(const Tensor& t, DType to);

// A convolution's bias on activations in any of float32, bfloat16 and float16, one GPU
// (elementwise.cu): y[i] = src[i] + b[channel] in float32 (__fadd_rn, as cudnnAddTensor on
// a float32 y), rounded once to y's type; src and y of one shape, [N, C, H, W] or, with
// channels_last, [N, H, W, C]; b float32 [C]. src may be y itself (in place) or a tensor
// of another activation dtype (a convolution's scratch output in its compute type).
void add_channel_bias(const Tensor& src, const Tensor& b, bool channels_last, Tensor& y);
// A convolution's bias gradient from a 4-D dy of any activation dtype, one GPU
// (batchnorm.cu): db[c] = S_c, or db[c] + S_c when accumulating, rounded to float once,
// S_c the sum of dy over N, H, W ([N, C, H, W], or [N, H, W, C] with channels_last) in
// double, in a fixed order (Note [Deterministic batch-norm reductions on the GPU]).
void channel_sums(const Tensor& dy, bool channels_last, Tensor& db, bool accumulate);

// What a cuDNN or cuBLAS call multiplies: `t` itself when it is already in the compute
// type (float32, or 16-bit activations of that type), else its copy converted to it,
// which `keep` holds until the call is queued.
inline const void* compute_operand(const Tensor& t, DType compute, Tensor& keep) {
  if (t.dtype() == compute) return t.raw_data();
  keep = t.dtype() == DType::Float32 ? narrowed(t, compute) : in_dtype(t, compute);
  return keep.raw_data();
}

// The dtype that an op's activation tensors (`tensors`, name and tensor; undefined ones
// are skipped) share: float32, bfloat16 or float16 (Note [16-bit activations] in
// tensor/ops.h). Anything else, or a mix, is an InternalError naming the op and the
// dtypes found. Float32 when none is defined (the other checks then report them).
inline DType activation_dtype(const char* op,
                              std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  bool found = false, same = true;
  DType dtype = DType::Float32;
  for (const auto& [name, t] : tensors) {
    if (!t->defined()) continue;
    if (!found) dtype = t->dtype();
    same = same && t->dtype() == dtype;
    found = true;
  }
  const auto dtypes_found = [&] {
    std::string seen;
    for (const auto& [name, t] : tensors) {
      if (t->defined()) seen += (seen.empty() ? "" : ", ") + std::string(name) + " " + dtype_name(t->dtype());
    }
    return seen;
  };
  MTRAIN_CHECK(same && is_floating(dtype),
               "{}: the activations must share one dtype, float32, bfloat16 or float16; found {}", op,
               dtypes_found());
  return dtype;
}

#ifdef __CUDACC__

// ---- storage types of activations, for kernels -----------------------------------------
// A kernel templated on its storage type T (float, __nv_bfloat16 or __half) loads with
// load_float, computes in float, and rounds once with store_as<T> (to nearest even);
// both are the identity for float, so a float32 instance does exactly what it did before.
template <class T> struct StorageDType;
template <> struct StorageDType<float> { static constexpr DType value = DType::Float32; };
template <> struct StorageDType<__nv_bfloat16> { static constexpr DType value = DType::BFloat16; };
template <> struct StorageDType<__half> { static constexpr DType value = DType::Float16; };

__device__ __forceinline__ float load_float(float v) { return v; }
__device__ __forceinline__ float load_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float load_float(__half v) { return __half2float(v); }

template <class T> __device__ __forceinline__ T store_as(float v);
template <> __device__ __forceinline__ float store_as<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 store_as<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half store_as<__half>(float v) { return __float2half_rn(v); }

// t's elements as T, which must be its dtype (as Tensor::data<T>() checks).
template <class T>
T* storage_data(const Tensor& t) {
  MTRAIN_CHECK(t.dtype() == StorageDType<T>::value, "expected a {} tensor, found {}",
               dtype_name(StorageDType<T>::value), t.str());
  return static_cast<T*>(t.raw_data());
}

template <class T> struct StorageTag { using type = T; };

// f(StorageTag<T>{}) with T the storage type of `dtype` (float32, bfloat16 or float16).
template <class F>
void with_storage(DType dtype, F&& f) {
  MTRAIN_CHECK(is_floating(dtype), "no activation storage type {}", dtype_name(dtype));
  if (dtype == DType::BFloat16) {
    f(StorageTag<__nv_bfloat16>{});
  } else if (dtype == DType::Float16) {
    f(StorageTag<__half>{});
  } else {
    f(StorageTag<float>{});
  }
}

#endif  // __CUDACC__

}  // namespace mtrain::cuda_ops::detail
