// Conversions between float32 and the 16-bit compute types on a GPU, for the cuDNN and
// cuBLAS kernels (Note [16-bit kernels on the GPU] in tensor/cuda_ops.h). Internal to
// tensor/cuda/.
#pragma once

#include "tensor/tensor.h"

namespace mtrain::cuda_ops::detail {

// A new `compute` (BFloat16 or Float16) tensor holding contiguous float32 `x` rounded to
// nearest even, from the caching allocator; queued on the current stream.
Tensor narrowed(const Tensor& x, DType compute);
// dst (+)= float32(src), elementwise; src 16-bit, dst float32 of the same size.
void widen_into(const Tensor& src, Tensor& dst, bool accumulate);

// What a cuDNN or cuBLAS call multiplies: float32 `t` itself, or for a 16-bit compute
// type its narrowed copy, which `keep` holds until the call is queued.
inline const void* compute_operand(const Tensor& t, DType compute, Tensor& keep) {
  if (compute == DType::Float32) return t.raw_data();
  keep = narrowed(t, compute);
  return keep.raw_data();
}

}  // namespace mtrain::cuda_ops::detail
