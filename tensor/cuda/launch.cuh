// Launch geometry, grid-stride loops and block reductions shared by mtrain's own CUDA
// kernels (tensor/cuda/*.cu). Header only; included by .cu files alone.
//
// Note [Kernel launch geometry]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Elementwise kernels use grid-stride loops with 64-bit indices (or 32-bit ones where
// the kernel divides by a per-element index and the sizes fit): the grid is sized for
// one element per thread but capped at kMaxBlocks, so a tensor of any length (past
// 2^31 elements too) needs one launch, and the block count, hence the launch cost,
// stays bounded. Sizes never depend on the device's properties, so a kernel's
// partial sums (and with them every rounding) are the same on every GPU model.
//
// Note [Unfused float arithmetic]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// nvcc contracts a * b + c into one FMA (one rounding instead of two) unless told
// otherwise; the CPU kernels, built for baseline x86-64 without FMA, round the product
// and the sum separately. Where a kernel mirrors a CPU formula (add_, pooling averages,
// batch-norm apply, the SGD update) it spells the operations with __fmul_rn, __fadd_rn
// and __fsub_rn, which nvcc never contracts, in the CPU's order: the GPU then produces
// the CPU's bits, and the tests can compare them exactly or nearly so.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/tensor.h"

namespace mtrain::cuda_ops::detail {

inline constexpr int kThreads = 256;
inline constexpr int kWarpSize = 32;
inline constexpr int kWarpsPerBlock = kThreads / kWarpSize;
// 65536 blocks of 256 threads: 16M threads, far more than any GPU keeps resident.
inline constexpr int64_t kMaxBlocks = 1 << 16;

// Blocks for a grid-stride loop over `n` items with `threads` threads per block.
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// The stream every kernel of `device` is queued on (Note [Current stream]).
inline cudaStream_t stream_for(int device) { return cuda::current_stream(device).handle(); }

// The GPU of an op's first tensor, which every other argument must share. The dispatch
// in ops:: only comes here for a GPU tensor, but a direct call with a host tensor would
// hand host pointers to a kernel, so that is checked too.
inline Device first_gpu(const char* op, const char* name, const Tensor& t,
                        DType dtype = DType::Float32) {
  MTRAIN_CHECK(t.defined() && t.device().is_cuda(), "{}: {} must be a GPU tensor, found {}", op,
               name, t.str());
  check_on(op, name, t, t.device(), dtype);
  return t.device();
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__device__ __forceinline__ int64_t global_thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Sum over the 32 lanes of a warp; every lane gets the result. The butterfly order is
// fixed, so the result is deterministic.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sum over a block of kThreads threads (all must call it); thread 0 gets the result.
// Fixed tree order: deterministic for a given block size. `shared` holds kWarpsPerBlock
// values and may be reused once every thread has returned (the trailing barrier).
template <class T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T total = T(0);
  if (warp == 0) {
    total = lane < kWarpsPerBlock ? shared[lane] : T(0);
    total = warp_sum(total);
  }
  __syncthreads();
  return total;
}

}  // namespace mtrain::cuda_ops::detail
