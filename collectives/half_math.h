// 16-bit floating point (IEEE float16 and bfloat16) arithmetic for the CPU backends'
// reductions. Gloo and MPI both reduce these types through the functions here, so the
// two backends give bit-identical results for the same inputs and reduction order.
//
// Note [Half-precision reductions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each combine of two elements widens both to float32, combines them in float32 and
// rounds the result back to the 16-bit format to nearest, ties to even (the rounding of
// CUDA's __float2half_rn and of PyTorch's CPU kernels). A float32 sum of two 16-bit
// values is exact, so each combine rounds exactly once, like an addition done natively
// in the 16-bit format. Across ranks the values are rounded after every combine, so a
// sum over more than two ranks depends on the order of the combines, as with every
// backend that reduces in the tensor's own type (NCCL included). avg is the rounded
// sum divided by the group size in float32, rounded once more. NaN stays NaN (quiet),
// in max and min too, whichever operand it is; float16 overflow becomes infinity.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/process_group.h"
#include "tensor/half_float.h"  // the element conversions
#include "tensor/tensor.h"

namespace mtrain::half {

// out[i] = combine(a[i], b[i]) over n 16-bit elements; `out` may alias `a` or `b`. The
// signature is gloo's reduce function (AllreduceOptions::setReduceFunction).
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

// The combine for a float16 or bfloat16 tensor: sum (also for avg, which divides
// afterwards), max or min. InvalidArgument for any other dtype.
ReduceFn reduce_fn(DType dtype, ReduceOp op);

// Avg's last step: every element of a float16/bfloat16 tensor divided by `divisor`.
void divide_in_place(const Tensor& tensor, int divisor);

inline bool is_half_dtype(DType dtype) {
  return dtype == DType::Float16 || dtype == DType::BFloat16;
}

}  // namespace mtrain::half
