// Max, average and global-average pooling on the GPU: the counterparts of
// tensor/cpu/pooling.cpp (Note [Kernel dispatch] in tensor/ops.cpp).
//
// Note [Deterministic pooling backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Overlapping windows (ResNet's 3x3 stride-2 max pool) send several output gradients
// to one input element. Float atomics would add them in whatever order the hardware
// picks, so two runs could differ in the last bits. Instead:
// - average pooling gathers: one thread per input element walks the windows that
//   cover it, in the CPU kernel's order (rows, then columns), so the sum is the CPU's;
// - max pooling cannot gather, because its backward receives only the argmax indices,
//   not the window geometry. One warp owns a plane and walks its outputs 32 at a time
//   in order; lanes whose outputs share an argmax are grouped (__match_any_sync) and the
//   lowest lane of each group adds the group's gradients in lane order. That is the CPU's
//   order too (outputs ascending), so results are deterministic and equal to the CPU's.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_ndim;
using detail::check_on;
using detail::check_on_shape;
using detail::first_gpu;
using detail::kThreads;
using detail::kWarpSize;
using detail::kWarpsPerBlock;

struct PoolGeometry {
  int64_t planes, h, w, oh, ow;
  int kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w;
};

// Checks x[N,C,H,W] / y[N,C,OH,OW] against the pooling parameters, with the CPU
// kernel's rules (tensor/cpu/pooling.cpp).
PoolGeometry pool_geometry(const char* op, const Tensor& x, const char* y_name, const Tensor& y,
                           const ops::Pool2dParams& p) {
  const Device device = first_gpu(op, "x", x);
  check_ndim(op, "x", x, 4);
  MTRAIN_CHECK(p.kernel_h >= 1 && p.kernel_w >= 1 && p.stride_h >= 1 && p.stride_w >= 1 &&
                   p.pad_h >= 0 && p.pad_w >= 0,
               "{}: invalid parameters kernel {}x{}, stride {}x{}, padding {}x{}", op, p.kernel_h,
               p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w);
  MTRAIN_CHECK(2 * p.pad_h <= p.kernel_h && 2 * p.pad_w <= p.kernel_w,
               "{}: padding {}x{} must be at most half of kernel {}x{}", op, p.pad_h, p.pad_w,
               p.kernel_h, p.kernel_w);
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = ops::pool_out_size(h, p.kernel_h, p.stride_h, p.pad_h, p.ceil_mode);
  const int64_t ow = ops::pool_out_size(w, p.kernel_w, p.stride_w, p.pad_w, p.ceil_mode);
  MTRAIN_CHECK(oh >= 1 && ow >= 1, "{}: kernel {}x{} with padding {}x{} does not fit input {}", op,
               p.kernel_h, p.kernel_w, p.pad_h, p.pad_w, shape_str(x.shape()));
  check_on_shape(op, y_name, y, device, {n, c, oh, ow});
  return {n * c, h, w, oh, ow, p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w};
}

// Output position `o` of a plane's flattened [OH, OW] grid and its plane.
struct OutputAt {
  int64_t plane, oy, ox;
};

__device__ __forceinline__ OutputAt output_at(int64_t o, const PoolGeometry& g) {
  const int64_t row = o / g.ow;
  return {row / g.oh, row % g.oh, o % g.ow};
}

// The input rows (or columns) [begin, end) that output position `o` covers, clipped to
// the input: window_span of the CPU kernel.
struct WindowSpan {
  int64_t begin, end;
};

__device__ __forceinline__ WindowSpan window_span(int64_t o, int stride, int pad, int kernel,
                                                  int64_t size) {
  const int64_t start = o * stride - pad;
  return {start < 0 ? 0 : start, start + kernel > size ? size : start + kernel};
}

// The output rows (or columns) [begin, end) whose windows cover input position `i`:
// those with o * stride - pad <= i < o * stride - pad + kernel, within [0, out_size).
__device__ __forceinline__ WindowSpan covering_outputs(int64_t i, int stride, int pad, int kernel,
                                                       int64_t out_size) {
  const int64_t first_past = i + pad - kernel;  // windows starting at or before this miss i
  const int64_t begin = first_past < 0 ? 0 : first_past / stride + 1;
  const int64_t last = (i + pad) / stride;
  return {begin, last + 1 < out_size ? last + 1 : out_size};
}

__global__ void maxpool_forward_kernel(const float* x, float* y, int32_t* indices,
                                       PoolGeometry g) {
  const int64_t total = g.planes * g.oh * g.ow;
  for (int64_t o = detail::global_thread_index(); o < total; o += detail::grid_stride()) {
    const OutputAt at = output_at(o, g);
    const WindowSpan rows = window_span(at.oy, g.stride_h, g.pad_h, g.kernel_h, g.h);
    const WindowSpan cols = window_span(at.ox, g.stride_w, g.pad_w, g.kernel_w, g.w);
    const float* xp = x + at.plane * g.h * g.w;
    float best = -INFINITY;
    int64_t best_at = rows.begin * g.w + cols.begin;
    for (int64_t iy = rows.begin; iy < rows.end; ++iy) {
      for (int64_t ix = cols.begin; ix < cols.end; ++ix) {
        const float v = xp[iy * g.w + ix];
        // As the CPU kernel (and PyTorch): the first maximum wins, a NaN wins and a later
        // NaN replaces it.
        if (v > best || isnan(v)) {
          best = v;
          best_at = iy * g.w + ix;
        }
      }
    }
    y[o] = best;
    indices[o] = static_cast<int32_t>(best_at);
  }
}

// Note [Deterministic pooling backward]. An index outside the plane (only a corrupted
// indices tensor has one) is skipped rather than written out of bounds.
__global__ void maxpool_backward_kernel(const float* dy, const int32_t* indices, float* dx,
                                        int64_t planes, int64_t in_plane, int64_t out_plane) {
  __shared__ float values[kWarpsPerBlock][kWarpSize];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const unsigned lanes_below = (1u << lane) - 1u;
  // Every loop bound below is the same for all lanes of a warp, as the *_sync calls need.
  for (int64_t plane = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; plane < planes;
       plane += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    float* dxp = dx + plane * in_plane;
    const float* dyp = dy + plane * out_plane;
    const int32_t* ip = indices + plane * out_plane;
    for (int64_t i = lane; i < in_plane; i += kWarpSize) dxp[i] = 0.0f;
    __syncwarp();
    for (int64_t base = 0; base < out_plane; base += kWarpSize) {
      const int64_t o = base + lane;
      const int64_t target = o < out_plane ? ip[o] : -1;
      const bool valid = target >= 0 && target < in_plane;
      values[warp][lane] = valid ? dyp[o] : 0.0f;
      // Lanes without a target get distinct negative keys, so they group with nobody.
      const long long key = valid ? target : -1 - lane;
      const unsigned group = __match_any_sync(0xffffffffu, key);
      __syncwarp();
      if (valid && (group & lanes_below) == 0) {
        float sum = dxp[target];
        for (unsigned rest = group; rest != 0; rest &= rest - 1) {
          sum = __fadd_rn(sum, values[warp][__ffs(rest) - 1]);
        }
        dxp[target] = sum;
      }
      // Orders this round's writes before the next round's reads of the same elements.
      __syncwarp();
    }
  }
}

// count_include_pad: every window's divisor is the full kernel area (inv_area).
__global__ void avgpool_forward_kernel(const float* x, float* y, PoolGeometry g, float inv_area) {
  const int64_t total = g.planes * g.oh * g.ow;
  for (int64_t o = detail::global_thread_index(); o < total; o += detail::grid_stride()) {
    const OutputAt at = output_at(o, g);
    const WindowSpan rows = window_span(at.oy, g.stride_h, g.pad_h, g.kernel_h, g.h);
    const WindowSpan cols = window_span(at.ox, g.stride_w, g.pad_w, g.kernel_w, g.w);
    const float* xp = x + at.plane * g.h * g.w;
    float sum = 0.0f;
    for (int64_t iy = rows.begin; iy < rows.end; ++iy) {
      for (int64_t ix = cols.begin; ix < cols.end; ++ix) sum = __fadd_rn(sum, xp[iy * g.w + ix]);
    }
    y[o] = __fmul_rn(sum, inv_area);
  }
}

// Gathers (Note [Deterministic pooling backward]): input element (iy, ix) sums the shares
// of the windows covering it, rows then columns ascending, as the CPU kernel adds them.
__global__ void avgpool_backward_kernel(const float* dy, float* dx, PoolGeometry g,
                                        float inv_area) {
  const int64_t total = g.planes * g.h * g.w;
  for (int64_t i = detail::global_thread_index(); i < total; i += detail::grid_stride()) {
    const int64_t row = i / g.w;
    const int64_t ix = i % g.w, iy = row % g.h, plane = row / g.h;
    const WindowSpan oys = covering_outputs(iy, g.stride_h, g.pad_h, g.kernel_h, g.oh);
    const WindowSpan oxs = covering_outputs(ix, g.stride_w, g.pad_w, g.kernel_w, g.ow);
    const float* dyp = dy + plane * g.oh * g.ow;
    float sum = 0.0f;
    for (int64_t oy = oys.begin; oy < oys.end; ++oy) {
      for (int64_t ox = oxs.begin; ox < oxs.end; ++ox) {
        sum = __fadd_rn(sum, __fmul_rn(dyp[oy * g.ow + ox], inv_area));
      }
    }
    dx[i] = sum;
  }
}

// One warp per plane: planes are small late in a network (7x7) and numerous.
__global__ void global_avgpool_forward_kernel(const float* x, float* y, int64_t planes,
                                              int64_t area, float inv_area) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  for (int64_t plane = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; plane < planes;
       plane += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const float* xp = x + plane * area;
    float sum = 0.0f;
    for (int64_t i = lane; i < area; i += kWarpSize) sum += xp[i];
    sum = detail::warp_sum(sum);
    if (lane == 0) y[plane] = __fmul_rn(sum, inv_area);
  }
}

__global__ void global_avgpool_backward_kernel(const float* dy, float* dx, int64_t total,
                                               int64_t area, float inv_area) {
  for (int64_t i = detail::global_thread_index(); i < total; i += detail::grid_stride()) {
    dx[i] = __fmul_rn(dy[i / area], inv_area);
  }
}

// Blocks for kernels that give each warp one plane.
unsigned grid_for_planes(int64_t planes) { return detail::grid_for(planes, kWarpsPerBlock); }

}  // namespace

void maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const ops::Pool2dParams& p) {
  const PoolGeometry g = pool_geometry("maxpool2d_forward", x, "y", y, p);
  check_on_shape("maxpool2d_forward", "indices", indices, x.device(), y.shape(), DType::Int32);
  MTRAIN_CHECK(g.h * g.w <= std::numeric_limits<int32_t>::max(),
               "maxpool2d_forward: plane {}x{} too large for int32 indices", g.h, g.w);
  const int64_t total = y.numel();
  if (total == 0) return;
  const int device = x.device().index;
  cuda::DeviceGuard guard(device);
  maxpool_forward_kernel<<<detail::grid_for(total), kThreads, 0, detail::stream_for(device)>>>(
      x.data<float>(), y.data<float>(), indices.data<int32_t>(), g);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void maxpool2d_backward(const Tensor& dy, const Tensor& indices, Tensor& dx) {
  const char* op = "maxpool2d_backward";
  const Device device = first_gpu(op, "dy", dy);
  check_on(op, "dx", dx, device);
  check_ndim(op, "dy", dy, 4);
  check_ndim(op, "dx", dx, 4);
  check_on_shape(op, "indices", indices, device, dy.shape(), DType::Int32);
  MTRAIN_CHECK(dx.size(0) == dy.size(0) && dx.size(1) == dy.size(1),
               "{}: dx {} and dy {} differ in N or C", op, shape_str(dx.shape()),
               shape_str(dy.shape()));
  const int64_t planes = dy.size(0) * dy.size(1);
  const int64_t in_plane = dx.size(2) * dx.size(3);
  const int64_t out_plane = dy.size(2) * dy.size(3);
  if (dx.numel() == 0) return;
  cuda::DeviceGuard guard(device.index);
  maxpool_backward_kernel<<<grid_for_planes(planes), kThreads, 0,
                            detail::stream_for(device.index)>>>(
      dy.data<float>(), indices.data<int32_t>(), dx.data<float>(), planes, in_plane, out_plane);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void avgpool2d_forward(const Tensor& x, Tensor& y, const ops::Pool2dParams& p) {
  MTRAIN_CHECK(!p.ceil_mode, "avgpool2d_forward: ceil_mode is for max pooling only");
  const PoolGeometry g = pool_geometry("avgpool2d_forward", x, "y", y, p);
  const int64_t total = y.numel();
  if (total == 0) return;
  const float inv_area = 1.0f / static_cast<float>(p.kernel_h * p.kernel_w);
  const int device = x.device().index;
  cuda::DeviceGuard guard(device);
  avgpool_forward_kernel<<<detail::grid_for(total), kThreads, 0, detail::stream_for(device)>>>(
      x.data<float>(), y.data<float>(), g, inv_area);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void avgpool2d_backward(const Tensor& dy, Tensor& dx, const ops::Pool2dParams& p) {
  MTRAIN_CHECK(!p.ceil_mode, "avgpool2d_backward: ceil_mode is for max pooling only");
  // The geometry is dx's (the forward's input); dy must be the matching output. The
  // first tensor, dy, sets the device, as for every op.
  const Device device = first_gpu("avgpool2d_backward", "dy", dy);
  check_on("avgpool2d_backward", "dx", dx, device);
  const PoolGeometry g = pool_geometry("avgpool2d_backward", dx, "dy", dy, p);
  const int64_t total = dx.numel();
  if (total == 0) return;
  const float inv_area = 1.0f / static_cast<float>(p.kernel_h * p.kernel_w);
  cuda::DeviceGuard guard(device.index);
  avgpool_backward_kernel<<<detail::grid_for(total), kThreads, 0,
                            detail::stream_for(device.index)>>>(dy.data<float>(),
                                                                dx.data<float>(), g, inv_area);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void global_avgpool_forward(const Tensor& x, Tensor& y) {
  const char* op = "global_avgpool_forward";
  const Device device = first_gpu(op, "x", x);
  check_ndim(op, "x", x, 4);
  check_on_shape(op, "y", y, device, {x.size(0), x.size(1), 1, 1});
  const int64_t planes = x.size(0) * x.size(1);
  const int64_t area = x.size(2) * x.size(3);
  if (planes == 0) return;
  // An empty plane averages to 0 (not 0/0), as on the CPU.
  const float inv_area = area > 0 ? 1.0f / static_cast<float>(area) : 0.0f;
  cuda::DeviceGuard guard(device.index);
  global_avgpool_forward_kernel<<<grid_for_planes(planes), kThreads, 0,
                                  detail::stream_for(device.index)>>>(
      x.data<float>(), y.data<float>(), planes, area, inv_area);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void global_avgpool_backward(const Tensor& dy, Tensor& dx) {
  const char* op = "global_avgpool_backward";
  const Device device = first_gpu(op, "dy", dy);
  check_on(op, "dx", dx, device);
  check_ndim(op, "dx", dx, 4);
  check_on_shape(op, "dy", dy, device, {dx.size(0), dx.size(1), 1, 1});
  const int64_t total = dx.numel();
  const int64_t area = dx.size(2) * dx.size(3);
  if (total == 0) return;
  const float inv_area = 1.0f / static_cast<float>(area);
  cuda::DeviceGuard guard(device.index);
  global_avgpool_backward_kernel<<<detail::grid_for(total), kThreads, 0,
                                   detail::stream_for(device.index)>>>(
      dy.data<float>(), dx.data<float>(), total, area, inv_area);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mtrain::cuda_ops
