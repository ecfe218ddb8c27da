// 16-bit floating point (IEEE float16 and bfloat16) arithmetic for the CPU backends' reductions.
// Gloo and MPI both reduce these types through the functions here, so the two backends give
// bit-identical results for the same inputs and reduction order. Each combine rounds once, to
// nearest even (Note [Half-precision reductions] in half_math.cpp). Pure functions, thread-safe.
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
