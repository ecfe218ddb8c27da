// CUDA memory as the rest of mtrain sees it, usable in builds with and without CUDA:
// the caching device allocator's statistics and cache, pinned host memory, and the
// record_stream contract. Device tensors themselves are made with
// Tensor::empty(shape, dtype, Device::cuda(i)); their memory comes from the per-device
// caching allocator (Note [Stream-ordered block reuse] in caching_block_allocator.h).
// Without CUDA every function here throws InvalidArgument saying the build has none.
#pragma once

#include "tensor/caching_block_allocator.h"
#include "tensor/tensor.h"

namespace mtrain {

// Statistics of the caching allocator of device `device` (cudaMalloc count = backend_allocs).
BlockAllocatorStats cuda_memory_stats(int device);
// Returns every cached block of `device` to the driver (waits for their events first).
void cuda_release_cached_memory(int device);

// Pinned (page-locked) host memory for staging copies: cached cudaHostAlloc blocks.
// Tensors from Tensor::empty_pinned() live here.
BlockAllocatorStats pinned_memory_stats();
void pinned_release_cached_memory();

// Declares that work queued so far, or later, on `stream_handle` of `device` (a
// cudaStream_t, passed opaquely so this header needs no CUDA) uses `tensor`'s memory:
// when the tensor's storage dies, its block is not reused until that work completes.
// For device tensors and pinned host tensors; other host tensors need no such care.
void record_stream(const Tensor& tensor, int device, void* stream_handle);

}  // namespace mtrain
