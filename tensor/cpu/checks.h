// Argument checks shared by the CPU kernels. A failed check is a bug in the caller
// (layers allocate the outputs), so it throws InternalError naming the op, the
// argument and both shapes.
#pragma once

#include <initializer_list>

#include "core/error.h"
#include "tensor/tensor.h"

namespace mtrain::ops::cpu {

// `t` must be a defined float32 CPU tensor.
inline void check_float(const char* op, const char* name, const Tensor& t) {
  MTRAIN_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MTRAIN_CHECK(t.dtype() == DType::Float32 && t.device().is_cpu(),
               "{}: {} must be a float32 CPU tensor, found {}", op, name, t.str());
}

inline void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  MTRAIN_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MTRAIN_CHECK(t.dtype() == dtype && t.device().is_cpu(), "{}: {} must be a {} CPU tensor, found {}",
               op, name, dtype_name(dtype), t.str());
}

inline void check_shape(const char* op, const char* name, const Tensor& t, const Shape& expected) {
  MTRAIN_CHECK(t.shape() == expected, "{}: {} expected shape {}, found {}", op, name,
               shape_str(expected), shape_str(t.shape()));
}

// A float32 tensor of exactly `expected` shape.
inline void check_float_shape(const char* op, const char* name, const Tensor& t,
                              const Shape& expected) {
  check_float(op, name, t);
  check_shape(op, name, t, expected);
}

inline void check_ndim(const char* op, const char* name, const Tensor& t, int ndim) {
  MTRAIN_CHECK(t.ndim() == ndim, "{}: {} must be {}-d, found shape {}", op, name, ndim,
               shape_str(t.shape()));
}

// Intra-op parallelism only pays off above this many elements: below it, opening a
// parallel region costs more than the vectorised loop it would split.
inline constexpr int64_t kParallelGrain = 1 << 15;

}  // namespace mtrain::ops::cpu
