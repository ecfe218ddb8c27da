// Check macros for CUDA-family calls: a failure throws mtrain::Error naming the call,
// the file and line, and the library's own error string.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define MTRAIN_CUDA_CHECK(call)                                                          \
  do {                                                                                   \
    cudaError_t mtrain_err_ = (call);                                                    \
    if (mtrain_err_ != cudaSuccess) {                                                    \
      throw ::mtrain::Error(::fmt::format("{} failed at {}:{}: {} ({})", #call, __FILE__, \
                                          __LINE__, cudaGetErrorString(mtrain_err_),      \
                                          cudaGetErrorName(mtrain_err_)));                \
    }                                                                                    \
  } while (0)
