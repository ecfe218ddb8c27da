// copy_channels on the host: one memcpy per image (ops::channel_block says which bytes);
// permute: a strided gather along y's last dimension (ops::permute_plan says from where).
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

void cpu::permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& y) {
  const PermutePlan plan = permute_plan(x, perm, y);
  if (plan.count == 0) return;
  cpu::use_configured_threads();
  const float* from = x.data<float>();
  float* to = y.data<float>();
  const int last = plan.rank - 1;
  const int64_t row = plan.dims[last], step = plan.x_strides[last], rows = plan.count / row;
#pragma omp parallel for if (plan.count >= cpu::kParallelGrain)
  for (int64_t r = 0; r < rows; ++r) {
    // r counts y's other dimensions row-major: the last of them fastest.
    int64_t begin = 0, rest = r;
    for (int d = last - 1; d >= 0; --d) {
      begin += rest % plan.dims[d] * plan.x_strides[d];
      rest /= plan.dims[d];
    }
    for (int64_t j = 0; j < row; ++j) to[r * row + j] = from[begin + j * step];
  }
}

}  // namespace mtrain::ops
