// Check macros for CUDA-family calls: a failure throws mtrain::Error naming the call,
// the file and line, and the library's own error string.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

namespace mtrain::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file,
                                          int line) {
  throw ::mtrain::Error(::fmt::format("{} failed at {}:{}: {} ({})", call, file, line,
                                      cudaGetErrorString(err), cudaGetErrorName(err)));
}

// Note [Not-ready queries]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// cudaEventQuery and cudaStreamQuery answer "still running" with cudaErrorNotReady, and
// the runtime also keeps that code as the calling thread's last error. Left there, the
// next kernel launch's cudaGetLastError() check throws "device not ready" although
// nothing failed (PyTorch clears it the same way). So a not-ready answer is consumed
// here, and every query goes through this function.
inline bool query_done(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  throw_cuda_error(err, call, file, line);
}

}  // namespace mtrain::cuda

#define MTRAIN_CUDA_CHECK(call)                                                        \
  do {                                                                                 \
    cudaError_t mtrain_err_ = (call);                                                  \
    if (mtrain_err_ != cudaSuccess) {                                                  \
      ::mtrain::cuda::throw_cuda_error(mtrain_err_, #call, __FILE__, __LINE__);        \
    }                                                                                  \
  } while (0)

// True when the queried work is done, false while it runs (clearing the not-ready
// code, Note [Not-ready queries]); any other answer throws as MTRAIN_CUDA_CHECK does.
#define MTRAIN_CUDA_QUERY(call) ::mtrain::cuda::query_done((call), #call, __FILE__, __LINE__)
