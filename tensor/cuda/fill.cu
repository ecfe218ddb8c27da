// Device kernels. For now: fill, used by the gpu-labelled plumbing test; the CUDA
// kernel set grows with the GPU path.
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/fill.h"

namespace mtrain::cuda {
namespace {
__global__ void fill_kernel(float* x, float value, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = value;
}
}  // namespace

void fill(float* device_ptr, float value, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  fill_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(device_ptr, value, n);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mtrain::cuda
