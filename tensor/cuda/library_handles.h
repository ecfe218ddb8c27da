// cuDNN and cuBLAS handles, their scratch memory, and the check macros for both
// libraries (CUDA builds only; internal to tensor/cuda/). Every thread has its own pair
// of handles per device, bound to its current stream of that device when asked for, and
// cuBLAS a workspace of its own per stream (Note [Library handles] in
// library_handles.cpp).
#pragma once

#include <cublas_v2.h>
#include <cudnn.h>

#include <cstddef>
#include <string>

#include "tensor/tensor.h"

namespace mtrain::cuda {

// The calling thread's handle for `device`, bound to current_stream(device). The caller
// makes `device` current (DeviceGuard) for the library calls that use it.
cudnnHandle_t cudnn_handle(int device);
// As cudnn_handle, with this stream's own workspace bound (Note [Library handles]).
cublasHandle_t cublas_handle(int device);

// `bytes` of scratch memory on `device`, for the current stream: a UInt8 tensor, or an
// undefined one when bytes == 0. Keep it until the library call that uses it is queued,
// then drop it: later work on the same stream, the only work that reuses its block, runs
// after that call (Note [Stream-ordered block reuse] in tensor/caching_block_allocator.h).
// Throws mtrain::Error when the allocator cannot find the memory even after returning its
// cache (its out-of-memory error).
Tensor workspace(int device, size_t bytes);

// The most workspace a single library call on `device` should ask for: what the driver
// has free plus what the caching allocator holds unused (it returns its cache and retries
// before giving up).
size_t workspace_limit(int device);

// A failed cuDNN call's status name and description, with cuDNN's more detailed message
// for this thread's last failure when it has one.
std::string cudnn_error_text(cudnnStatus_t status);

// Throw mtrain::Error naming the failed call, what it was doing (`context`: the op and
// its shapes), the file and line, and the library's status name and description.
[[noreturn]] void throw_cudnn_error(cudnnStatus_t status, const char* call,
                                    const std::string& context, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call,
                                     const std::string& context, const char* file, int line);

}  // namespace mtrain::cuda

// MTRAIN_CUDNN_CHECK(call, context): `context` (a std::string expression) is only
// evaluated when the call fails, so describing the shapes costs nothing on success.
#define MTRAIN_CUDNN_CHECK(call, context)                                                  \
  do {                                                                                     \
    const cudnnStatus_t mtrain_cudnn_status_ = (call);                                     \
    if (mtrain_cudnn_status_ != CUDNN_STATUS_SUCCESS) {                                    \
      ::mtrain::cuda::throw_cudnn_error(mtrain_cudnn_status_, #call, (context), __FILE__,  \
                                        __LINE__);                                         \
    }                                                                                      \
  } while (0)

#define MTRAIN_CUBLAS_CHECK(call, context)                                                 \
  do {                                                                                     \
    const cublasStatus_t mtrain_cublas_status_ = (call);                                   \
    if (mtrain_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                  \
      ::mtrain::cuda::throw_cublas_error(mtrain_cublas_status_, #call, (context), __FILE__, \
                                         __LINE__);                                        \
    }                                                                                      \
  } while (0)
