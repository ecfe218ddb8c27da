// What Tensor needs from the CUDA path, behind a CUDA-free interface: tensor/cuda/
// implements it in CUDA builds and tensor/no_cuda.cpp otherwise (every function then
// throws InvalidArgument saying the build has no CUDA). Internal to tensor/.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace mtrain::detail {

// The caching allocator of `device` (InvalidArgument when no such device exists).
Allocator& cuda_allocator(int device);
Allocator& pinned_allocator();
// Makes the blocks of `stream` (a cudaStream_t) of `device` private to it, or ordinary
// again (CachingBlockAllocator::set_private; Note [Captured steps] in cuda_graph.h).
void set_private_stream(int device, void* stream, bool on);

// dst <- src where at least one is on a GPU; same dtype and numel, checked by the caller.
// Queued on the current stream of the GPU involved (the destination's for
// device-to-device). Returns with host memory safe to touch: a host source may be
// reused and a host destination read, except with `non_blocking` and pinned host memory,
// where the caller synchronises the stream first (PyTorch's non_blocking=True).
void cuda_copy(const Tensor& dst, const Tensor& src, bool non_blocking);

// Queued on the device's current stream.
void cuda_zero(const Tensor& t);
void cuda_fill(const Tensor& t, float value);  // float32

}  // namespace mtrain::detail
