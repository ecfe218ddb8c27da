// Max, average and global-average pooling. Each (n, c) plane is independent, so the
// loops parallelise over planes and no two threads ever write the same element.
#include <cmath>
#include <limits>

#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

struct PoolGeometry {
  int64_t planes, h, w, oh, ow;
};

// Checks x[N,C,H,W] / y[N,C,OH,OW] against the pooling parameters.
PoolGeometry pool_geometry(const char* op, const Tensor& x, const char* y_name, const Tensor& y,
                           const Pool2dParams& p) {
  cpu::check_float(op, "x", x);
  cpu::check_ndim(op, "x", x, 4);
  MTRAIN_CHECK(p.kernel_h >= 1 && p.kernel_w >= 1 && p.stride_h >= 1 && p.stride_w >= 1 &&
                   p.pad_h >= 0 && p.pad_w >= 0,
               "{}: invalid parameters kernel {}x{}, stride {}x{}, padding {}x{}", op, p.kernel_h,
               p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w);
  // PyTorch's rule: padding at most half the kernel, so every window sees at least
  // one real element (otherwise a max window would be all -inf).
  MTRAIN_CHECK(2 * p.pad_h <= p.kernel_h && 2 * p.pad_w <= p.kernel_w,
               "{}: padding {}x{} must be at most half of kernel {}x{}", op, p.pad_h, p.pad_w,
               p.kernel_h, p.kernel_w);
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = pool_out_size(h, p.kernel_h, p.stride_h, p.pad_h, p.ceil_mode);
  const int64_t ow = pool_out_size(w, p.kernel_w, p.stride_w, p.pad_w, p.ceil_mode);
  MTRAIN_CHECK(oh >= 1 && ow >= 1, "{}: kernel {}x{} with padding {}x{} does not fit input {}", op,
               p.kernel_h, p.kernel_w, p.pad_h, p.pad_w, shape_str(x.shape()));
  cpu::check_shape(op, y_name, y, {n, c, oh, ow});
  return {n * c, h, w, oh, ow};
}

// The input rows (or columns) [begin, end) that output position `o` covers: the
// window starts at o * stride - pad and is clipped to the input [0, size).
struct WindowSpan {
  int64_t begin, end;
};

inline WindowSpan window_span(int64_t o, int stride, int pad, int kernel, int64_t size) {
  const int64_t start = o * stride - pad;
  return {start < 0 ? 0 : start, start + kernel > size ? size : start + kernel};
}

// Note [Tiled pooling]
// ~~~~~~~~~~~~~~~~~~~~
// When windows tile the input (kernel == stride, no padding), as in LeNet's 2x2 average
// pools, the window arithmetic and clipping above are wasted work: each output row reads
// `k` whole input rows, and in backward every input element belongs to at most one
// window. These loops sum in the same order as the general ones (row by row, left to
// right), so results are bit-identical; they only drop per-element bookkeeping. Input
// rows and columns past the last whole window belong to no window.
bool tiles(const Pool2dParams& p) {
  return p.kernel_h == p.stride_h && p.kernel_w == p.stride_w && p.pad_h == 0 && p.pad_w == 0;
}

void avgpool_tiled_forward(const float* xp, float* yp, const PoolGeometry& g, int kh, int kw, float inv_area) {
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    const float* row = xp + oy * kh * g.w;
    float* out = yp + oy * g.ow;
    if (kh == 2 && kw == 2) {
      const float* next = row + g.w;
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        out[ox] = (((row[2 * ox] + row[2 * ox + 1]) + next[2 * ox]) + next[2 * ox + 1]) * inv_area;
      }
      continue;
    }
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      float sum = 0.0f;
      for (int iy = 0; iy < kh; ++iy) {
        for (int ix = 0; ix < kw; ++ix) sum += row[iy * g.w + ox * kw + ix];
      }
      out[ox] = sum * inv_area;
    }
  }
}

void avgpool_tiled_backward(const float* dyp, float* dxp, const PoolGeometry& g, int kh, int kw, float inv_area) {
  const int64_t covered_w = g.ow * kw;
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    const float* grad = dyp + oy * g.ow;
    for (int iy = 0; iy < kh; ++iy) {
      float* row = dxp + (oy * kh + iy) * g.w;
      if (kw == 2) {
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const float share = grad[ox] * inv_area;
          row[2 * ox] = share;
          row[2 * ox + 1] = share;
        }
      } else {
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const float share = grad[ox] * inv_area;
          for (int ix = 0; ix < kw; ++ix) row[ox * kw + ix] = share;
        }
      }
      for (int64_t x = covered_w; x < g.w; ++x) row[x] = 0.0f;
    }
  }
  for (int64_t i = g.oh * kh * g.w; i < g.h * g.w; ++i) dxp[i] = 0.0f;
}

// Note [Max pooling by rows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// One output row at a time, the kernel's taps in the outer loops (row-major, the
// window order) and the row's outputs in the inner loop: each tap compares one input
// per output without a branch, and the inner loop has no bounds checks, since the
// range of outputs whose window holds that tap is computed once. Every output still
// sees its window's elements in row-major order, and a value replaces the current
// best when it is strictly greater or NaN, so the first maximum wins and a NaN
// propagates exactly as before (and as PyTorch's CPU max pooling records indices).
// Scanning each output's window with a data-dependent branch took 21 ms for
// ResNet-18's stem pool at batch 64 (64 x 64 planes, 28x28 -> 14x14, one thread), 20
// times the backward pass; this takes 7 ms (build/tests/bench_kernels 1 8 64). A
// constant stride of 1 or 2 lets the compiler unroll the strided loads; compiling for
// AVX-512/AVX2 as well measured slower (13 ms): the rows are only 14 outputs long.

// One tap of the kernel over the outputs [lo, hi) of a row; kStride 0 = p.stride_w at
// run time (Note [Max pooling by rows]).
template <int64_t kStride>
[[gnu::always_inline]] inline void maxpool_tap(const float* __restrict row, float* __restrict best,
                                               int32_t* __restrict at, int64_t lo, int64_t hi,
                                               int64_t offset, int64_t runtime_stride, int32_t base) {
  const int64_t stride = kStride != 0 ? kStride : runtime_stride;
  for (int64_t ox = lo; ox < hi; ++ox) {
    const float v = row[ox * stride + offset];
    const float b = best[ox];
    // Bitwise |: no branch on the data.
    const bool take = (v > b) | (v != v);
    best[ox] = take ? v : b;
    at[ox] = take ? base + static_cast<int32_t>(ox * stride) : at[ox];
  }
}

void maxpool_plane(const float* __restrict xp, float* __restrict yp, int32_t* __restrict ip,
                   const PoolGeometry& g, const Pool2dParams& p) {
  // Locals, so that the stores below cannot alias them.
  const int64_t w = g.w, ow = g.ow, stride = p.stride_w, kernel_w = p.kernel_w, pad = p.pad_w;
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    const auto [ys, ye] = window_span(oy, p.stride_h, p.pad_h, p.kernel_h, g.h);
    float* __restrict best = yp + oy * ow;
    int32_t* __restrict at = ip + oy * ow;
    for (int64_t ox = 0; ox < ow; ++ox) {
      // A window of only -inf (or empty) reports its first element inside the input.
      const int64_t xs = window_span(ox, static_cast<int>(stride), static_cast<int>(pad),
                                     static_cast<int>(kernel_w), w).begin;
      best[ox] = -std::numeric_limits<float>::infinity();
      at[ox] = static_cast<int32_t>(ys * w + xs);
    }
    for (int64_t iy = ys; iy < ye; ++iy) {
      const float* __restrict row = xp + iy * w;
      for (int64_t kx = 0; kx < kernel_w; ++kx) {
        // Outputs whose window holds column ix = ox * stride + offset inside [0, w).
        const int64_t offset = kx - pad;
        const int64_t lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
        const int64_t hi = std::min<int64_t>(w - 1 - offset < 0 ? 0 : (w - 1 - offset) / stride + 1, ow);
        const int32_t base = static_cast<int32_t>(iy * w + offset);
        switch (stride) {
          case 1: maxpool_tap<1>(row, best, at, lo, hi, offset, stride, base); break;
          case 2: maxpool_tap<2>(row, best, at, lo, hi, offset, stride, base); break;
          default: maxpool_tap<0>(row, best, at, lo, hi, offset, stride, base); break;
        }
      }
    }
  }
}

}  // namespace

void cpu::maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const Pool2dParams& p) {
  const PoolGeometry g = pool_geometry("maxpool2d_forward", x, "y", y, p);
  cpu::check_float("maxpool2d_forward", "y", y);
  cpu::check_dtype("maxpool2d_forward", "indices", indices, DType::Int32);
  cpu::check_shape("maxpool2d_forward", "indices", indices, y.shape());
  MTRAIN_CHECK(g.h * g.w <= std::numeric_limits<int32_t>::max(),
               "maxpool2d_forward: plane {}x{} too large for int32 indices", g.h, g.w);
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  int32_t* pi = indices.data<int32_t>();
#pragma omp parallel for if (g.planes * g.oh * g.ow >= cpu::kParallelGrain / 8)
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    maxpool_plane(px + plane * g.h * g.w, py + plane * g.oh * g.ow, pi + plane * g.oh * g.ow, g, p);
  }
}

void cpu::maxpool2d_backward(const Tensor& dy, const Tensor& indices, Tensor& dx) {
  cpu::check_float("maxpool2d_backward", "dy", dy);
  cpu::check_float("maxpool2d_backward", "dx", dx);
  cpu::check_ndim("maxpool2d_backward", "dy", dy, 4);
  cpu::check_ndim("maxpool2d_backward", "dx", dx, 4);
  cpu::check_dtype("maxpool2d_backward", "indices", indices, DType::Int32);
  cpu::check_shape("maxpool2d_backward", "indices", indices, dy.shape());
  MTRAIN_CHECK(dx.size(0) == dy.size(0) && dx.size(1) == dy.size(1),
               "maxpool2d_backward: dx {} and dy {} differ in N or C", shape_str(dx.shape()),
               shape_str(dy.shape()));
  cpu::use_configured_threads();
  const int64_t planes = dy.size(0) * dy.size(1);
  const int64_t in_plane = dx.size(2) * dx.size(3);
  const int64_t out_plane = dy.size(2) * dy.size(3);
  const float* pdy = dy.data<float>();
  const int32_t* pi = indices.data<int32_t>();
  float* pdx = dx.data<float>();
  bool bad_index = false;
#pragma omp parallel for if (planes * in_plane >= cpu::kParallelGrain / 4) reduction(|| : bad_index)
  for (int64_t plane = 0; plane < planes; ++plane) {
    float* dxp = pdx + plane * in_plane;
    const float* dyp = pdy + plane * out_plane;
    const int32_t* ip = pi + plane * out_plane;
    for (int64_t i = 0; i < in_plane; ++i) dxp[i] = 0.0f;
    for (int64_t o = 0; o < out_plane; ++o) {
      const int64_t at = ip[o];
      if (at < 0 || at >= in_plane) {
        bad_index = true;
        continue;
      }
      dxp[at] += dyp[o];
    }
  }
  MTRAIN_CHECK(!bad_index, "maxpool2d_backward: an index lies outside the {}x{} input plane of dx {}",
               dx.size(2), dx.size(3), shape_str(dx.shape()));
}

void cpu::avgpool2d_forward(const Tensor& x, Tensor& y, const Pool2dParams& p) {
  MTRAIN_CHECK(!p.ceil_mode, "avgpool2d_forward: ceil_mode is for max pooling only");
  const PoolGeometry g = pool_geometry("avgpool2d_forward", x, "y", y, p);
  cpu::check_float("avgpool2d_forward", "y", y);
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  // count_include_pad=true and no ceil mode: every window lies inside the padded
  // input, so the divisor is always the full kernel area.
  const float inv_area = 1.0f / static_cast<float>(p.kernel_h * p.kernel_w);
  if (tiles(p)) {
#pragma omp parallel for if (g.planes * g.oh * g.ow >= cpu::kParallelGrain / 8)
    for (int64_t plane = 0; plane < g.planes; ++plane) {
      avgpool_tiled_forward(px + plane * g.h * g.w, py + plane * g.oh * g.ow, g, p.kernel_h, p.kernel_w, inv_area);
    }
    return;
  }
#pragma omp parallel for if (g.planes * g.oh * g.ow >= cpu::kParallelGrain / 8)
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    const float* xp = px + plane * g.h * g.w;
    float* yp = py + plane * g.oh * g.ow;
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      const auto [ys, ye] = window_span(oy, p.stride_h, p.pad_h, p.kernel_h, g.h);
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        const auto [xs, xe] = window_span(ox, p.stride_w, p.pad_w, p.kernel_w, g.w);
        float sum = 0.0f;
        for (int64_t iy = ys; iy < ye; ++iy) {
          for (int64_t ix = xs; ix < xe; ++ix) sum += xp[iy * g.w + ix];
        }
        yp[oy * g.ow + ox] = sum * inv_area;
      }
    }
  }
}

void cpu::avgpool2d_backward(const Tensor& dy, Tensor& dx, const Pool2dParams& p) {
  MTRAIN_CHECK(!p.ceil_mode, "avgpool2d_backward: ceil_mode is for max pooling only");
  const PoolGeometry g = pool_geometry("avgpool2d_backward", dx, "dy", dy, p);
  cpu::check_float("avgpool2d_backward", "dy", dy);
  cpu::use_configured_threads();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  const float inv_area = 1.0f / static_cast<float>(p.kernel_h * p.kernel_w);
  if (tiles(p)) {
#pragma omp parallel for if (g.planes * g.h * g.w >= cpu::kParallelGrain / 4)
    for (int64_t plane = 0; plane < g.planes; ++plane) {
      avgpool_tiled_backward(pdy + plane * g.oh * g.ow, pdx + plane * g.h * g.w, g, p.kernel_h, p.kernel_w, inv_area);
    }
    return;
  }
#pragma omp parallel for if (g.planes * g.h * g.w >= cpu::kParallelGrain / 4)
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    float* dxp = pdx + plane * g.h * g.w;
    const float* dyp = pdy + plane * g.oh * g.ow;
    for (int64_t i = 0; i < g.h * g.w; ++i) dxp[i] = 0.0f;
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      const auto [ys, ye] = window_span(oy, p.stride_h, p.pad_h, p.kernel_h, g.h);
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        const auto [xs, xe] = window_span(ox, p.stride_w, p.pad_w, p.kernel_w, g.w);
        const float share = dyp[oy * g.ow + ox] * inv_area;
        for (int64_t iy = ys; iy < ye; ++iy) {
          for (int64_t ix = xs; ix < xe; ++ix) dxp[iy * g.w + ix] += share;
        }
      }
    }
  }
}

void cpu::global_avgpool_forward(const Tensor& x, Tensor& y) {
  cpu::check_float("global_avgpool_forward", "x", x);
  cpu::check_ndim("global_avgpool_forward", "x", x, 4);
  cpu::check_float_shape("global_avgpool_forward", "y", y, {x.size(0), x.size(1), 1, 1});
  cpu::use_configured_threads();
  const int64_t planes = x.size(0) * x.size(1);
  const int64_t area = x.size(2) * x.size(3);
  const float* px = x.data<float>();
  float* py = y.data<float>();
  // An empty plane averages to 0 (not 0/0).
  const float inv_area = area > 0 ? 1.0f / static_cast<float>(area) : 0.0f;
#pragma omp parallel for if (planes * area >= cpu::kParallelGrain)
  for (int64_t plane = 0; plane < planes; ++plane) {
    const float* xp = px + plane * area;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < area; ++i) sum += xp[i];
    py[plane] = sum * inv_area;
  }
}

void cpu::global_avgpool_backward(const Tensor& dy, Tensor& dx) {
  cpu::check_float("global_avgpool_backward", "dx", dx);
  cpu::check_ndim("global_avgpool_backward", "dx", dx, 4);
  cpu::check_float_shape("global_avgpool_backward", "dy", dy, {dx.size(0), dx.size(1), 1, 1});
  cpu::use_configured_threads();
  const int64_t planes = dx.size(0) * dx.size(1);
  const int64_t area = dx.size(2) * dx.size(3);
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  const float inv_area = area > 0 ? 1.0f / static_cast<float>(area) : 0.0f;
#pragma omp parallel for if (planes * area >= cpu::kParallelGrain)
  for (int64_t plane = 0; plane < planes; ++plane) {
    const float v = pdy[plane] * inv_area;
    float* dxp = pdx + plane * area;
#pragma omp simd
    for (int64_t i = 0; i < area; ++i) dxp[i] = v;
  }
}

}  // namespace mtrain::ops
