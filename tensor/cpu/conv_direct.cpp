// Direct convolution kernels for single-channel inputs.
//
// Note [Single-channel convolution]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A network's first convolution on grey-scale images (LeNet's 1->6 5x5) is where
// oneDNN 2.6 serves us worst. Its fast kernels write outputs in a 16-channel blocked
// layout, so six output channels are padded to sixteen, and the result has to be
// reordered to NCHW (and the incoming gradient back) at every step; its NCHW-output
// path is a GEMM that is slower still. Measured per call with 1 thread, batch 256,
// 28x28 input, on the 2-core AVX-512 VM, median of 25:
//
//                       forward                 backward-weights
//   oneDNN blocked     1.43 + 0.91 reorder     1.32 + 0.51 reorder (+1.0 in training,
//                                              where the tensors come cold from memory)
//   oneDNN NCHW (gemm) 3.79                    5.14
//   these kernels      0.89                    1.48
//
// At sixteen output channels oneDNN wins again (2.08 against 2.57 ms forward), and
// with more input channels its blocked kernels have no padding to waste, so
// direct_conv_applies() keeps these kernels to one input channel and at most eight
// outputs, stride 1 and kernels up to 7 wide. Backward-data of a single-channel
// layer is oneDNN's NCHW path (conv.cpp); a first layer usually skips it anyway.
//
// The kernels work on one image at a time, copied into a zero-padded buffer whose
// rows are a whole number of 16-float tiles wide, so every load is a full vector
// with no edge cases: an output row is computed tile by tile, each tile keeping the
// accumulators of up to eight output channels in registers. GCC's vector extension
// plus target_clones compile each kernel for AVX-512, AVX2 and the baseline, and the
// loader picks the best one the CPU has (the project builds without -march).
// Threads split the batch; backward-weights gives each thread its own accumulators
// and adds them up in a fixed order, so results depend only on the thread count.
#include "tensor/cpu/conv_direct.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "tensor/cpu/batch_kernels.h"

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
  int64_t dy_row() const { return tiles * kLanes; }
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

// dy of one image, rows padded to whole tiles with zeros (so the tail lanes add
// nothing), plus its per-channel sum into bias_acc[o][16].
MTRAIN_CLONES void stage_gradient(const Layout& l, const float* dy, float* dy_pad,
                                  float* bias_acc) {
  const DirectConvShape& s = l.s;
  for (int64_t o = 0; o < s.o; ++o) {
    Vec sum;
    load(sum, bias_acc + o * kLanes);
    for (int64_t oh = 0; oh < s.oh; ++oh) {
      float* row = dy_pad + (o * s.oh + oh) * l.dy_row();
      std::memcpy(row, dy + (o * s.oh + oh) * s.ow, s.ow * sizeof(float));
      for (int64_t t = 0; t < l.tiles; ++t) {
        Vec v;
        load(v, row + t * kLanes);
        sum += v;
      }
    }
    store(bias_acc + o * kLanes, sum);
  }
}

// Adds one image's dw[o0 .. o0+OB)[kh][kw] into acc[o][kh][kw][16]. For each kernel
// row, OB x KW accumulators stay in registers across the whole image.
template <int OB, int KW>
MTRAIN_CLONES void weight_grad_channels(const Layout& l, const float* buf, const float* dy_pad,
                                        float* acc, int64_t o0) {
  const DirectConvShape& s = l.s;
  for (int64_t kh = 0; kh < s.kh; ++kh) {
    Vec sum[OB][KW];
    for (int o = 0; o < OB; ++o) {
      for (int kw = 0; kw < KW; ++kw) sum[o][kw] = Vec{};
    }
    for (int64_t oh = 0; oh < s.oh; ++oh) {
      const float* in = buf + (oh + kh) * l.row;
      for (int64_t t = 0; t < l.tiles; ++t) {
        Vec d[OB];
        for (int o = 0; o < OB; ++o) load(d[o], dy_pad + ((o0 + o) * s.oh + oh) * l.dy_row() + t * kLanes);
        for (int kw = 0; kw < KW; ++kw) {
          Vec xv;
          load(xv, in + t * kLanes + kw);
          for (int o = 0; o < OB; ++o) sum[o][kw] += d[o] * xv;
        }
      }
    }
    for (int o = 0; o < OB; ++o) {
      for (int kw = 0; kw < KW; ++kw) {
        float* p = acc + (((o0 + o) * s.kh + kh) * KW + kw) * kLanes;
        Vec v;
        load(v, p);
        store(p, v + sum[o][kw]);
      }
    }
  }
}

template <int KW>
void weight_grad_image(const Layout& l, const float* buf, const float* dy_pad, float* acc) {
  // Blocks of three channels: 3 x 7 accumulators, three gradients and one input
  // vector fit AVX-512's 32 registers.
  int64_t o0 = 0;
  for (; o0 + 3 <= l.s.o; o0 += 3) weight_grad_channels<3, KW>(l, buf, dy_pad, acc, o0);
  switch (l.s.o - o0) {
    case 2: weight_grad_channels<2, KW>(l, buf, dy_pad, acc, o0); break;
    case 1: weight_grad_channels<1, KW>(l, buf, dy_pad, acc, o0); break;
  }
}

void weight_grad_image(const Layout& l, const float* buf, const float* dy_pad, float* acc) {
  switch (l.s.kw) {
    case 1: return weight_grad_image<1>(l, buf, dy_pad, acc);
    case 2: return weight_grad_image<2>(l, buf, dy_pad, acc);
    case 3: return weight_grad_image<3>(l, buf, dy_pad, acc);
    case 4: return weight_grad_image<4>(l, buf, dy_pad, acc);
    case 5: return weight_grad_image<5>(l, buf, dy_pad, acc);
    case 6: return weight_grad_image<6>(l, buf, dy_pad, acc);
    case 7: return weight_grad_image<7>(l, buf, dy_pad, acc);
  }
}

}  // namespace

bool direct_conv_applies(int64_t in_channels, int64_t out_channels, int64_t kh, int64_t kw,
                         int64_t stride_h, int64_t stride_w) {
  return in_channels == 1 && out_channels >= 1 && out_channels <= kMaxOutChannels && kh >= 1 &&
         kw >= 1 && kw <= kMaxKernelWidth && stride_h == 1 && stride_w == 1;
}

void direct_conv_forward(const float* x, const float* w, const float* b, float* y,
                         const DirectConvShape& s) {
  const Layout l = layout_of(s);
  const int nthreads = threads_for(s.n);
  const size_t per_thread = static_cast<size_t>(l.image());
  float* const base = thread_scratch(per_thread * nthreads);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    const int i = omp_get_thread_num();
    float* buf = base + per_thread * i;
    std::fill(buf, buf + per_thread, 0.0f);
    for (int64_t n = split(s.n, i, nthreads); n < split(s.n, i + 1, nthreads); ++n) {
      pad_image(l, x + n * s.h * s.w, buf);
      forward_image(l, buf, w, b, y + n * s.o * s.oh * s.ow);
    }
  }
}

void direct_conv_backward_weights(const float* x, const float* dy, float* dw, float* db,
                                  bool accumulate, const DirectConvShape& s) {
  const Layout l = layout_of(s);
  const int nthreads = threads_for(s.n);
  const int64_t weights = s.o * s.kh * s.kw;
  // Per thread: the padded image, the padded gradient, then the accumulators.
  const size_t acc_offset = static_cast<size_t>(l.image() + s.o * s.oh * l.dy_row());
  const size_t per_thread = acc_offset + static_cast<size_t>((weights + s.o) * kLanes);
  float* const base = thread_scratch(per_thread * nthreads);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    const int i = omp_get_thread_num();
    float* buf = base + per_thread * i;
    float* dy_pad = buf + l.image();
    float* acc = buf + acc_offset;
    float* bias_acc = acc + weights * kLanes;
    std::fill(buf, buf + per_thread, 0.0f);
    for (int64_t n = split(s.n, i, nthreads); n < split(s.n, i + 1, nthreads); ++n) {
      pad_image(l, x + n * s.h * s.w, buf);
      stage_gradient(l, dy + n * s.o * s.oh * s.ow, dy_pad, bias_acc);
      weight_grad_image(l, buf, dy_pad, acc);
    }
  }
  reduce_weight_grads(base, per_thread, nthreads, acc_offset, weights, s.o, dw, db, accumulate);
}

}  // namespace mtrain::ops::cpu
