// Copies, zero_ and fill_ of GPU tensors, on the current stream (tensor/cuda_hooks.h).
#include <fmt/format.h>

#include "core/error.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/fill.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_memory.h"
#include "tensor/cuda_hooks.h"
#include "tensor/cuda_ops.h"
#include "tensor/ops.h"

namespace mtrain::detail {

void cuda_copy(const Tensor& dst, const Tensor& src, bool non_blocking) {
  const size_t bytes = dst.nbytes();
  if (bytes == 0) return;
  const Device to = dst.device();
  const Device from = src.device();
  if (to.is_cuda() && from.is_cuda()) {
    const cuda::Stream stream = cuda::current_stream(to.index);
    cuda::DeviceGuard guard(to.index);
    if (to.index == from.index) {
      MTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), bytes,
                                        cudaMemcpyDeviceToDevice, stream.handle()));
      return;
    }
    // The source was written on its own device's current stream: order the copy after
    // it, and keep its block from being reused before the copy has read it.
    cuda::Event ready(from.index);
    ready.record(cuda::current_stream(from.index));
    ready.block(stream);
    MTRAIN_CUDA_CHECK(cudaMemcpyPeerAsync(dst.raw_data(), to.index, src.raw_data(), from.index,
                                          bytes, stream.handle()));
    record_stream(src, to.index, stream.handle());
    return;
  }
  if (to.is_cuda()) {
    const cuda::Stream stream = cuda::current_stream(to.index);
    cuda::DeviceGuard guard(to.index);
    MTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), bytes,
                                      cudaMemcpyHostToDevice, stream.handle()));
    // From pageable memory CUDA returns once it has staged the source, so the caller may
    // reuse it at once; from pinned memory the DMA reads it later.
    if (src.is_pinned()) {
      if (non_blocking) {
        record_stream(src, to.index, stream.handle());
      } else {
        stream.synchronize();
      }
    }
    return;
  }
  MTRAIN_CHECK(from.is_cuda(), "cuda_copy between {} and {}", from.str(), to.str());
  const cuda::Stream stream = cuda::current_stream(from.index);
  cuda::DeviceGuard guard(from.index);
  MTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), bytes, cudaMemcpyDeviceToHost,
                                    stream.handle()));
  if (non_blocking && dst.is_pinned()) {
    record_stream(dst, from.index, stream.handle());
  } else {
    stream.synchronize();
  }
}

void cuda_zero(const Tensor& t) {
  if (t.nbytes() == 0) return;
  const int device = t.device().index;
  cuda::DeviceGuard guard(device);
  MTRAIN_CUDA_CHECK(cudaMemsetAsync(t.raw_data(), 0, t.nbytes(), cuda::current_stream(device).handle()));
}

void cuda_fill(const Tensor& t, float value) {
  const int device = t.device().index;
  cuda::DeviceGuard guard(device);
  cuda::fill(t.data<float>(), value, t.numel(), cuda::current_stream(device).handle());
}

}  // namespace mtrain::detail

namespace mtrain::cuda_ops {

// One strided copy on the current stream: `batch` rows of `bytes`, each at its own pitch.
void copy_channels(const Tensor& src, int64_t src_offset, Tensor& dst, int64_t dst_offset, int64_t channels) {
  const ops::ChannelBlock b = ops::channel_block(src, src_offset, dst, dst_offset, channels);
  if (b.bytes == 0 || b.batch == 0) return;
  const int device = src.device().index;
  cuda::DeviceGuard guard(device);
  MTRAIN_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst.raw_data()) + b.dst_begin, b.dst_pitch,
                                      static_cast<const char*>(src.raw_data()) + b.src_begin, b.src_pitch, b.bytes,
                                      static_cast<size_t>(b.batch), cudaMemcpyDeviceToDevice,
                                      cuda::current_stream(device).handle()));
}

}  // namespace mtrain::cuda_ops
