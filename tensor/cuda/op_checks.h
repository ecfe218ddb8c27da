// Argument checks shared by the GPU entries (their contract is in tensor/cuda_ops.h).
// A failed check is a bug in the caller, so each throws InternalError naming the op,
// the argument and what it found.
#pragma once

#include "core/error.h"
#include "tensor/tensor.h"

namespace mtrain::cuda_ops::detail {

// `t` must be defined, of `dtype`, and on the GPU `device`.
inline void check_on(const char* op, const char* name, const Tensor& t, Device device,
                     DType dtype = DType::Float32) {
  MTRAIN_CHECK(t.defined(), "{}: {} is undefined", op, name);
  MTRAIN_CHECK(t.dtype() == dtype && t.device() == device,
               "{}: {} must be a {} tensor on {}, found {}", op, name, dtype_name(dtype),
               device.str(), t.str());
}

// As check_on, and of exactly `expected` shape.
inline void check_on_shape(const char* op, const char* name, const Tensor& t, Device device,
                           const Shape& expected, DType dtype = DType::Float32) {
  check_on(op, name, t, device, dtype);
  MTRAIN_CHECK(t.shape() == expected, "{}: {} expected shape {}, found {}", op, name,
               shape_str(expected), shape_str(t.shape()));
}

inline void check_ndim(const char* op, const char* name, const Tensor& t, int ndim) {
  MTRAIN_CHECK(t.ndim() == ndim, "{}: {} must be {}-d, found shape {}", op, name, ndim,
               shape_str(t.shape()));
}

}  // namespace mtrain::cuda_ops::detail
