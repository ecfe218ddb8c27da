// copy_channels on the host: one memcpy per image (ops::channel_block says which bytes).
#include <cstring>

#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {

void cpu::copy_channels(const Tensor& src, int64_t src_offset, Tensor& dst, int64_t dst_offset, int64_t channels) {
  const ChannelBlock b = channel_block(src, src_offset, dst, dst_offset, channels);
  if (b.bytes == 0) return;
  cpu::use_configured_threads();
  const char* from = static_cast<const char*>(src.raw_data()) + b.src_begin;
  char* to = static_cast<char*>(dst.raw_data()) + b.dst_begin;
#pragma omp parallel for if (static_cast<int64_t>(b.bytes) * b.batch >= cpu::kParallelGrain * 4)
  for (int64_t n = 0; n < b.batch; ++n) {
    std::memcpy(to + static_cast<size_t>(n) * b.dst_pitch, from + static_cast<size_t>(n) * b.src_pitch, b.bytes);
  }
}

}  // namespace mtrain::ops
