#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace mtrain::cuda {

// x[0..n) = value on `stream` (asynchronous).
void fill(float* device_ptr, float value, int64_t n, cudaStream_t stream = nullptr);

}  // namespace mtrain::cuda
