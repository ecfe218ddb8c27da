// Direct convolution forward for single-channel inputs.
//
// Note [Single-channel convolution]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A network's first convolution on grey-scale images (LeNet's 1->6 5x5) is where
// oneDNN 2.6 serves us worst. Its fast kernels write outputs in a 16-channel blocked
// layout, so six output channels are padded to sixteen, and the result has to be
// reordered to NCHW at every step; its NCHW-output path is a GEMM that is slower
// still. Measured per call with 1 thread, batch 256, 28x28 input, on the 2-core
// AVX-512 VM, median of 25: oneDNN blocked 1.43 ms + 0.91 ms reorder, oneDNN NCHW
// (gemm) 3.79 ms, this kernel 0.89 ms.
//
// At sixteen output channels oneDNN wins again (2.08 against 2.57 ms), and with more
// input channels its blocked kernels have no padding to waste, so
// direct_conv_applies() keeps this kernel to one input channel and at most eight
// outputs, stride 1 and kernels up to 7 wide. The weight gradient of the same layers
// runs with images in the vector lanes (Note [Images in the vector lanes] in
// conv_lanes.cpp), which measured faster than a direct kernel of this kind (0.8
// against 1.8 ms for LeNet's first layer); their backward-data is oneDNN's NCHW path
// (conv.cpp), and a first layer usually skips it anyway.
//
// The kernel works on one image at a time, copied into a zero-padded buffer whose
// rows are a whole number of 16-float tiles wide, so every load is a full vector
// with no edge cases: an output row is computed tile by tile, each tile keeping the
// accumulators of up to eight output channels in registers. Threads split the batch.
#include "tensor/cpu/conv_direct.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "tensor/cpu/conv_support.h"

namespace mtrain::ops::cpu {
namespace {

constexpr int64_t kMaxOutChannels = 8;
constexpr int64_t kMaxKernelWidth = 7;

// Geometry of one padded image and the tiled output rows.
struct Layout {
  DirectConvShape s;
  int64_t tiles;       // 16-float tiles per output row
  int64_t row;         // floats per padded input row: tiles * 16 + kw
  int64_t rows;        // padded input rows: h + 2 * pad_h
  int64_t image() const { return rows * row; }
};

Layout layout_of(const DirectConvShape& s) {
  Layout l{s, (s.ow + kLanes - 1) / kLanes, 0, s.h + 2 * s.pad_h};
  l.row = l.tiles * kLanes + s.kw;
  return l;
}

// Copies image x[h,w] into the interior of the zero-padded buffer; the border was
// zeroed once and is never written.
void pad_image(const Layout& l, const float* x, float* buf) {
  const DirectConvShape& s = l.s;
  for (int64_t r = 0; r < s.h; ++r) {
    std::memcpy(buf + (r + s.pad_h) * l.row + s.pad_w, x + r * s.w, s.w * sizeof(float));
  }
}

// Outputs [o0, o0 + OB) of one image.
template <int OB>
MTRAIN_CLONES void forward_channels(const Layout& l, const float* buf, const float* w,
                                    const float* b, float* y, int64_t o0) {
  const DirectConvShape& s = l.s;
  const int64_t taps = s.kh * s.kw;
  for (int64_t oh = 0; oh < s.oh; ++oh) {
    for (int64_t t = 0; t < l.tiles; ++t) {
      Vec acc[OB];
      for (int o = 0; o < OB; ++o) acc[o] = Vec{} + (b ? b[o0 + o] : 0.0f);
      for (int64_t kh = 0; kh < s.kh; ++kh) {
        const float* in = buf + (oh + kh) * l.row + t * kLanes;
        const float* wk = w + o0 * taps + kh * s.kw;
        for (int64_t kw = 0; kw < s.kw; ++kw) {
          Vec xv;
          load(xv, in + kw);
          for (int o = 0; o < OB; ++o) acc[o] += wk[o * taps + kw] * xv;
        }
      }
      const int64_t valid = std::min(kLanes, s.ow - t * kLanes);
      for (int o = 0; o < OB; ++o) {
        std::memcpy(y + ((o0 + o) * s.oh + oh) * s.ow + t * kLanes, &acc[o], valid * sizeof(float));
      }
    }
  }
}

void forward_image(const Layout& l, const float* buf, const float* w, const float* b, float* y) {
  // One pass over all channels (o <= 8): the input tile is loaded once per tap.
  switch (l.s.o) {
    case 1: return forward_channels<1>(l, buf, w, b, y, 0);
    case 2: return forward_channels<2>(l, buf, w, b, y, 0);
    case 3: return forward_channels<3>(l, buf, w, b, y, 0);
    case 4: return forward_channels<4>(l, buf, w, b, y, 0);
    case 5: return forward_channels<5>(l, buf, w, b, y, 0);
    case 6: return forward_channels<6>(l, buf, w, b, y, 0);
    case 7: return forward_channels<7>(l, buf, w, b, y, 0);
    case 8: return forward_channels<8>(l, buf, w, b, y, 0);
  }
}

}  // namespace

bool direct_conv_applies(int64_t in_channels, int64_t out_channels, int64_t kh, int64_t kw,
                         int64_t stride_h, int64_t stride_w) {
  return cpu_has_avx512() && in_channels == 1 && out_channels >= 1 && out_channels <= kMaxOutChannels &&
         kh >= 1 && kw >= 1 && kw <= kMaxKernelWidth && stride_h == 1 && stride_w == 1;
}

void direct_conv_forward(const float* x, const float* w, const float* b, float* y,
                         const DirectConvShape& s) {
  const Layout l = layout_of(s);
  const int nthreads = threads_for(s.n);
  const size_t per_thread = static_cast<size_t>(l.image());
  float* const base = thread_scratch(per_thread * nthreads);
  for_each_part(s.n, nthreads, [&](int part, int64_t first, int64_t last) {
    float* buf = base + per_thread * static_cast<size_t>(part);
    std::fill(buf, buf + per_thread, 0.0f);
    for (int64_t n = first; n < last; ++n) {
      pad_image(l, x + n * s.h * s.w, buf);
      forward_image(l, buf, w, b, y + n * s.o * s.oh * s.ow);
    }
  });
}

}  // namespace mtrain::ops::cpu
