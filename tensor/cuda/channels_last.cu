// Channels-last layout changes and global average pooling on the GPU: the counterparts of
// tensor/cpu/channels_last.cpp (Note [Channels last] in tensor/ops.h); permute, the general
// layout change (tensor/cpu/channel_copy.cpp's).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_ndim;
using detail::check_on_shape;
using detail::first_gpu;
using detail::kThreads;
using detail::kWarpSize;

constexpr int kTile = 32;
constexpr int kTileRows = 8;  // a block is kTile x kTileRows threads

// out[b, k, r] = in[b, r, k] for a batch of [rows, cols] matrices, through a shared tile
// so that both the reads and the writes of a warp are 32 neighbours.
__global__ void layout_copy_kernel(const float* in, float* out, int64_t batches, int64_t rows,
                                         int64_t cols) {
  __shared__ float tile[kTile][kTile + 1];  // +1: no bank conflicts on the transposed read
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t matrix = rows * cols;
  for (int64_t b = blockIdx.z; b < batches; b += gridDim.z) {
    const float* src = in + b * matrix;
    float* dst = out + b * matrix;
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t r = r0 + j, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[j][threadIdx.x] = src[r * cols + c];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t c = c0 + j, r = r0 + threadIdx.x;
      if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][j];
    }
    __syncthreads();
  }
}

void transpose_batches(Device device, const float* in, float* out, int64_t batches, int64_t rows,
                       int64_t cols) {
  if (batches == 0 || rows == 0 || cols == 0) return;
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  MTRAIN_CHECK(row_tiles <= 65535, "a layout change of {} rows is more than one launch covers", rows);
  MTRAIN_CHECK(col_tiles <= 0x7fffffff, "a layout change of {} columns is more than one launch covers", cols);
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles),
                  static_cast<unsigned>(std::min<int64_t>(batches, 65535)));
  cuda::DeviceGuard guard(device.index);
  layout_copy_kernel<<<grid, dim3(kTile, kTileRows), 0, detail::stream_for(device.index)>>>(
      in, out, batches, rows, cols);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

// y[b, k] = (sum over s of x[b, s, k], in s order) * inv_area: one thread per (b, k), a
// warp over 32 neighbouring channels.
__global__ void global_avgpool_channels_last_kernel(const float* x, float* y, int64_t batches,
                                                    int64_t area, int64_t channels, float inv_area) {
  for (int64_t i = detail::global_thread_index(); i < batches * channels; i += detail::grid_stride()) {
    const int64_t b = i / channels, k = i % channels;
    const float* column = x + b * area * channels + k;
    float sum = 0.0f;
    for (int64_t s = 0; s < area; ++s) sum = __fadd_rn(sum, column[s * channels]);
    y[i] = __fmul_rn(sum, inv_area);
  }
}

__global__ void global_avgpool_channels_last_backward_kernel(const float* dy, float* dx, int64_t total,
                                                             int64_t area, int64_t channels, float inv_area) {
  for (int64_t i = detail::global_thread_index(); i < total; i += detail::grid_stride()) {
    const int64_t b = i / (area * channels), k = i % channels;
    dx[i] = __fmul_rn(dy[b * channels + k], inv_area);
  }
}

}  // namespace

void to_channels_last(const Tensor& x, Tensor& y) {
  const Device device = first_gpu("to_channels_last", "x", x);
  check_ndim("to_channels_last", "x", x, 4);
  check_on_shape("to_channels_last", "y", y, device, {x.size(0), x.size(2), x.size(3), x.size(1)});
  transpose_batches(device, x.data<float>(), y.data<float>(), x.size(0), x.size(1), x.size(2) * x.size(3));
}

void from_channels_last(const Tensor& x, Tensor& y) {
  const Device device = first_gpu("from_channels_last", "x", x);
  check_ndim("from_channels_last", "x", x, 4);
  check_on_shape("from_channels_last", "y", y, device, {x.size(0), x.size(3), x.size(1), x.size(2)});
  transpose_batches(device, x.data<float>(), y.data<float>(), x.size(0), x.size(1) * x.size(2), x.size(3));
}

void global_avgpool_forward_channels_last(const Tensor& x, Tensor& y) {
  const char* op = "global_avgpool_forward_channels_last";
  const Device device = first_gpu(op, "x", x);
  check_ndim(op, "x", x, 4);
  const int64_t n = x.size(0), area = x.size(1) * x.size(2), c = x.size(3);
  check_on_shape(op, "y", y, device, {n, 1, 1, c});
  if (n * c == 0) return;
  // An empty plane averages to 0 (not 0/0), as on the CPU.
  const float inv_area = area > 0 ? 1.0f / static_cast<float>(area) : 0.0f;
  cuda::DeviceGuard guard(device.index);
  global_avgpool_channels_last_kernel<<<detail::grid_for(n * c), kThreads, 0, detail::stream_for(device.index)>>>(
      x.data<float>(), y.data<float>(), n, area, c, inv_area);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void global_avgpool_backward_channels_last(const Tensor& dy, Tensor& dx) {
  const char* op = "global_avgpool_backward_channels_last";
  const Device device = first_gpu(op, "dy", dy);
  check_ndim(op, "dx", dx, 4);
  const int64_t n = dx.size(0), area = dx.size(1) * dx.size(2), c = dx.size(3);
  check_on_shape(op, "dy", dy, device, {n, 1, 1, c});
  detail::check_on(op, "dx", dx, device);
  const int64_t total = dx.numel();
  if (total == 0) return;
  const float inv_area = area > 0 ? 1.0f / static_cast<float>(area) : 0.0f;
  cuda::DeviceGuard guard(device.index);
  global_avgpool_channels_last_backward_kernel<<<detail::grid_for(total), kThreads, 0,
                                                 detail::stream_for(device.index)>>>(
      dy.data<float>(), dx.data<float>(), total, area, c, inv_area);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

namespace {

// One thread per element of y: its index in y's dimensions, then x's offset from them.
__global__ void permute_kernel(const float* x, float* y, ops::PermutePlan plan) {
  for (int64_t i = detail::global_thread_index(); i < plan.count; i += detail::grid_stride()) {
    int64_t from = 0, rest = i;
    for (int d = plan.rank - 1; d >= 0; --d) {
      from += rest % plan.dims[d] * plan.x_strides[d];
      rest /= plan.dims[d];
    }
    y[i] = x[from];
  }
}

}  // namespace

void permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& y) {
  const ops::PermutePlan plan = ops::permute_plan(x, perm, y);
  const Device device = first_gpu("permute", "x", x);
  if (plan.count == 0) return;
  cuda::DeviceGuard guard(device.index);
  permute_kernel<<<detail::grid_for(plan.count), kThreads, 0, detail::stream_for(device.index)>>>(
      x.data<float>(), y.data<float>(), plan);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mtrain::cuda_ops
