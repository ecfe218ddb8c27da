// Convolution gradients with sixteen images in the vector lanes.
//
// Note [Images in the vector lanes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// oneDNN 2.6 computes LeNet's second convolution (6 -> 16, 5x5, on 14x14 maps) forward
// at about 100 GFLOP/s on this VM's AVX-512 core, but its gradients at a third and a
// half of that: 3.2 ms backward-data and 2.3 ms backward-weights per call against
// 1.2 ms forward (batch 256, 1 thread). Together they were a third of LeNet's step.
// A kernel with neighbouring pixels of one image in a vector's lanes wastes lanes on
// such maps: an output row is 10 pixels, and backward-data, a full correlation, reads
// 4 padding zeros on either side of every 10-pixel gradient row. With the same pixel
// of sixteen images in the lanes instead, every lane does useful work at every tap,
// and backward-data's loops visit only the taps that touch the map, so its borders
// cost nothing (backward-weights walks the zero-padded input).
//
// Each call copies blocks of sixteen images into that layout, [channel][row][col][16]
// (the input inside its zero padding, lanes past the end of the batch zero), by 16x16
// transposes in registers, and the input gradient back the same way:
// - backward-data: for each input pixel, the accumulators of all (at most eight)
//   input channels stay in registers while the loop runs over the output channels and
//   the taps whose output pixel exists; each gradient vector loaded feeds one FMA per
//   input channel, with the weight broadcast from a [o][kh][kw][c] copy.
// - backward-weights: for one input channel and kernel row, a few output channels
//   times the kernel width of accumulators stay in registers over a block's whole map;
//   at the end the lanes are summed, then the threads, in a fixed order and in double,
//   so the result depends only on the thread count.
// Threads split the blocks of images.
//
// Measured with tests/tensor/bench_kernels (process CPU ms per call, 1 thread; oneDNN
// in its faster blocked layout, reorders included):
//
//                              backward-data          backward-weights
//                              oneDNN   these         oneDNN   these
//   6 -> 16 5x5 @14, batch 256   3.22   1.26-1.28       2.26   1.25-1.27
//   1 -> 6 5x5 pad 2 @28, 256       -       -           2.03   0.79-0.89 (a direct
//                                                              kernel: 1.78-1.85)
//   1 -> 8 3x3 pad 1 @28, 256       -       -           1.43   0.63-0.74 (direct: 2.33)
//   1 -> 16 5x5 pad 2 @28, 256      -       -           2.65   2.62
//   batch 64:
//   3 -> 16 3x3 pad 1 @32        2.93   1.38            0.70   1.27
//   8 -> 16 5x5 pad 2 @28        6.09   2.90            4.01   3.04
//   16 -> 32 3x3 pad 1 @14       1.02   1.23            1.14   2.13
//   16 -> 32 5x5 @12             0.95   1.13            1.10   1.15
//
// So conv.cpp sends backward-data here for stride 1 and 2-8 input channels (at most 32
// outputs, 7-wide kernels and maps of 1024 pixels, 32x32, the reach measured), and
// backward-weights for the same shapes with kernels 5 to 7 wide, where each input
// vector loaded feeds enough FMAs, and for single-channel inputs with at most eight
// outputs. The zero-padded map (and so the gradient map) may hold at most 48x48
// pixels: the per-thread buffers grow with it, and padding wider than that is not
// something a network does. These figures are AVX-512's, so the rules require it
// (cpu_has_avx512()), with one exception. On a Zen 3 EPYC with AVX2 and FMA and no
// AVX-512, which runs the x86-64-v3 clones (conv_support.h), the single-channel
// weight gradient runs too (2026-11-26, `bench_kernels 1 256 64 cpu`, six alternating
// runs with the rules on and off; that VM's spread between runs is wide):
//
//                              backward-data          backward-weights
//                              oneDNN   these         oneDNN     these
//   1 -> 6 5x5 pad 2 @28, 256       -       -         10.0-15.8  7.6-9.4
//   1 -> 4 7x7 pad 3 @28, 256       -       -         17.3-24.1  7.9-9.2
//   1 -> 8 3x3 pad 1 @28, 256       -       -         6.1-10.0   6.1-7.6
//   6 -> 16 5x5 @14, 256         3.2-4.7  16.7-17.4   2.9-4.4    8.3-8.7
//   8 -> 16 5x5 pad 2 @28, 256   22-28    164-194     21-27      83-98
//
// The few-channel shapes lose there by 2-7x (the last rows; sixteen lanes take two of
// AVX2's sixteen registers, so their accumulators likely spill, not checked), as does the
// direct forward kernel (1 -> 6 5x5: 11-15 against 3-5 ms), so oneDNN keeps them on such
// CPUs. (Winograd has a rule of its own for such CPUs: Note [Winograd convolution].)
#include "tensor/cpu/conv_lanes.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "tensor/cpu/conv_support.h"

namespace mtrain::ops::cpu {
namespace {

// The reach measured against oneDNN (Note [Images in the vector lanes]).
constexpr int64_t kMaxInChannels = 8;
constexpr int64_t kMaxOutChannels = 32;
constexpr int64_t kMaxPixels = 32 * 32;
constexpr int64_t kMaxPaddedPixels = 48 * 48;
constexpr int64_t kMaxKernelWidth = 7;
constexpr int64_t kMinWeightsKernelWidth = 5;  // backward-weights, 2+ input channels
constexpr int64_t kMaxSingleChannelOutputs = 8;  // backward-weights, 1 input channel

// dx of one block: dyl[o][oh][ow][16], wt[o][kh][kw][C], dxl[C][h][w][16].
template <int C>
MTRAIN_CLONES void data_grad_channels(const ConvGeometry& s, const float* dyl, const float* wt,
                                      float* dxl) {
  for (int64_t y = 0; y < s.h; ++y) {
    // Kernel rows i whose output row y + pad_h - i lies in [0, oh).
    const int64_t i_lo = std::max<int64_t>(0, y + s.pad_h - (s.oh - 1));
    const int64_t i_hi = std::min<int64_t>(s.kh - 1, y + s.pad_h);
    for (int64_t x = 0; x < s.w; ++x) {
      const int64_t j_lo = std::max<int64_t>(0, x + s.pad_w - (s.ow - 1));
      const int64_t j_hi = std::min<int64_t>(s.kw - 1, x + s.pad_w);
      Vec acc[C];
      for (int c = 0; c < C; ++c) acc[c] = Vec{};
      for (int64_t k = 0; k < s.o; ++k) {
        for (int64_t i = i_lo; i <= i_hi; ++i) {
          const float* drow = dyl + (k * s.oh + y + s.pad_h - i) * s.ow * kLanes;
          const float* wrow = wt + (k * s.kh + i) * s.kw * C;
          for (int64_t j = j_lo; j <= j_hi; ++j) {
            Vec d;
            load(d, drow + (x + s.pad_w - j) * kLanes);
            for (int c = 0; c < C; ++c) acc[c] += wrow[j * C + c] * d;
          }
        }
      }
      for (int c = 0; c < C; ++c) store(dxl + ((c * s.h + y) * s.w + x) * kLanes, acc[c]);
    }
  }
}

void data_grad_block(const ConvGeometry& s, const float* dyl, const float* wt, float* dxl) {
  static_assert(kMaxInChannels == 8);
  switch (s.c) {
    case 2: return data_grad_channels<2>(s, dyl, wt, dxl);
    case 3: return data_grad_channels<3>(s, dyl, wt, dxl);
    case 4: return data_grad_channels<4>(s, dyl, wt, dxl);
    case 5: return data_grad_channels<5>(s, dyl, wt, dxl);
    case 6: return data_grad_channels<6>(s, dyl, wt, dxl);
    case 7: return data_grad_channels<7>(s, dyl, wt, dxl);
    case 8: return data_grad_channels<8>(s, dyl, wt, dxl);
    default: MTRAIN_CHECK(false, "lanes backward-data: {} input channels are outside the kernels' reach", s.c);
  }
}

// Adds one block's dw[o0 .. o0 + OB)[c][kh][KW] into acc[o][c][kh][KW][16]:
// xl[c][oh + kh - 1][ow + KW - 1][16] (padded), dyl[o][oh][ow][16].
template <int OB, int KW>
MTRAIN_CLONES void weight_grad_outputs(const ConvGeometry& s, const float* xl, const float* dyl,
                                       float* acc, int64_t o0) {
  const int64_t row = s.w + 2 * s.pad_w;
  const int64_t plane = (s.h + 2 * s.pad_h) * row;
  for (int64_t c = 0; c < s.c; ++c) {
    for (int64_t i = 0; i < s.kh; ++i) {
      Vec sum[OB][KW];
      for (int ob = 0; ob < OB; ++ob) {
        for (int j = 0; j < KW; ++j) load(sum[ob][j], acc + ((((o0 + ob) * s.c + c) * s.kh + i) * KW + j) * kLanes);
      }
      for (int64_t y = 0; y < s.oh; ++y) {
        const float* xrow = xl + (c * plane + (y + i) * row) * kLanes;
        for (int64_t x = 0; x < s.ow; ++x) {
          Vec xv[KW];
          for (int j = 0; j < KW; ++j) load(xv[j], xrow + (x + j) * kLanes);
          for (int ob = 0; ob < OB; ++ob) {
            Vec d;
            load(d, dyl + (((o0 + ob) * s.oh + y) * s.ow + x) * kLanes);
            for (int j = 0; j < KW; ++j) sum[ob][j] += d * xv[j];
          }
        }
      }
      for (int ob = 0; ob < OB; ++ob) {
        for (int j = 0; j < KW; ++j) store(acc + ((((o0 + ob) * s.c + c) * s.kh + i) * KW + j) * kLanes, sum[ob][j]);
      }
    }
  }
}

// The most output channels per pass for kernel width KW: OB x KW accumulators, KW
// input vectors and one gradient fit AVX-512's 32 registers.
constexpr int max_out_block(int kw) { return std::min(8, (32 - 1 - kw) / kw); }

template <int KW, int OB = max_out_block(KW)>
void weight_grad_pass(int ob, const ConvGeometry& s, const float* xl, const float* dyl,
                      float* acc, int64_t o0) {
  if constexpr (OB > 1) {
    if (ob < OB) return weight_grad_pass<KW, OB - 1>(ob, s, xl, dyl, acc, o0);
  }
  weight_grad_outputs<OB, KW>(s, xl, dyl, acc, o0);
}

// Output channels in as few passes as the registers allow, of near-equal size.
template <int KW>
void weight_grad_passes(const ConvGeometry& s, const float* xl, const float* dyl, float* acc) {
  const int64_t passes = (s.o + max_out_block(KW) - 1) / max_out_block(KW);
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t o0 = split(s.o, static_cast<int>(p), static_cast<int>(passes));
    const int64_t o1 = split(s.o, static_cast<int>(p + 1), static_cast<int>(passes));
    weight_grad_pass<KW>(static_cast<int>(o1 - o0), s, xl, dyl, acc, o0);
  }
}

void weight_grad_block(const ConvGeometry& s, const float* xl, const float* dyl, float* acc) {
  switch (s.kw) {
    case 1: return weight_grad_passes<1>(s, xl, dyl, acc);
    case 2: return weight_grad_passes<2>(s, xl, dyl, acc);
    case 3: return weight_grad_passes<3>(s, xl, dyl, acc);
    case 4: return weight_grad_passes<4>(s, xl, dyl, acc);
    case 5: return weight_grad_passes<5>(s, xl, dyl, acc);
    case 6: return weight_grad_passes<6>(s, xl, dyl, acc);
    case 7: return weight_grad_passes<7>(s, xl, dyl, acc);
    default: MTRAIN_CHECK(false, "lanes backward-weights: kernel width {} is outside the kernels' reach", s.kw);
  }
}

// Adds the block's per-channel sums of dyl[o][oh][ow][16] into bias_acc[o][16].
MTRAIN_CLONES void bias_grad_block(const ConvGeometry& s, const float* dyl, float* bias_acc) {
  const int64_t positions = s.oh * s.ow;
  for (int64_t o = 0; o < s.o; ++o) {
    Vec sum;
    load(sum, bias_acc + o * kLanes);
    for (int64_t p = 0; p < positions; ++p) {
      Vec v;
      load(v, dyl + (o * positions + p) * kLanes);
      sum += v;
    }
    store(bias_acc + o * kLanes, sum);
  }
}

// Finishes the weight gradient: thread t's kLanes partial sums for dw[j] start at
// base + t * stride + offset + j * kLanes, and those for db[o] (db may be null) follow
// the `weights` values of dw. Lanes, then threads, are summed in a fixed order, in
// double; with accumulate the totals are added to what dw and db hold.
void reduce_weight_grads(const float* base, size_t stride, int threads, size_t offset,
                         int64_t weights, int64_t outputs, float* dw, float* db, bool accumulate) {
  auto total = [&](int64_t index) {
    double sum = 0.0;
    for (int t = 0; t < threads; ++t) {
      const float* lanes = base + stride * static_cast<size_t>(t) + offset + index * kLanes;
      for (int64_t k = 0; k < kLanes; ++k) sum += lanes[k];
    }
    return static_cast<float>(sum);
  };
  for (int64_t j = 0; j < weights; ++j) dw[j] = (accumulate ? dw[j] : 0.0f) + total(j);
  if (db) {
    for (int64_t o = 0; o < outputs; ++o) db[o] = (accumulate ? db[o] : 0.0f) + total(weights + o);
  }
}

// The shapes both directions handle: stride 1, kernels at most kMaxKernelWidth wide,
// maps and padded maps within the measured reach (the instruction set is the caller's
// rule).
bool lanes_reach(const ConvGeometry& s) {
  return s.stride_h == 1 && s.stride_w == 1 && s.kh >= 1 && s.kw >= 1 &&
         s.kw <= kMaxKernelWidth && s.o >= 1 && s.h * s.w <= kMaxPixels &&
         (s.h + 2 * s.pad_h) * (s.w + 2 * s.pad_w) <= kMaxPaddedPixels;
}

}  // namespace

bool lanes_backward_data_applies(const ConvGeometry& s) {
  return cpu_has_avx512() && lanes_reach(s) && s.c >= 2 && s.c <= kMaxInChannels && s.o <= kMaxOutChannels;
}

bool lanes_backward_weights_applies(const ConvGeometry& s) {
  if (!lanes_reach(s)) return false;
  // Single-channel inputs on AVX2 too (the table above); the rest on AVX-512 only.
  if (s.c == 1) return s.o <= kMaxSingleChannelOutputs && (cpu_has_avx512() || cpu_has_x86_64_v3());
  return cpu_has_avx512() && s.c >= 2 && s.c <= kMaxInChannels && s.o <= kMaxOutChannels && s.kw >= kMinWeightsKernelWidth;
}

void lanes_conv_backward_data(const float* dy, const float* w, float* dx, const ConvGeometry& s) {
  const int64_t blocks = blocks_of(s.n);
  const int nthreads = threads_for(blocks);
  const int64_t taps = s.kh * s.kw;
  const size_t dy_floats = static_cast<size_t>(s.o * s.oh * s.ow * kLanes);
  const size_t per_thread = dy_floats + static_cast<size_t>(s.c * s.h * s.w * kLanes);
  const size_t weights = static_cast<size_t>(s.o * s.c * taps);
  float* const wt = thread_scratch(weights + per_thread * nthreads);
  float* const base = wt + weights;
  for (int64_t k = 0; k < s.o; ++k) {
    for (int64_t c = 0; c < s.c; ++c) {
      for (int64_t t = 0; t < taps; ++t) wt[(k * taps + t) * s.c + c] = w[(k * s.c + c) * taps + t];
    }
  }
  for_each_part(blocks, nthreads, [&](int part, int64_t first, int64_t last) {
    float* dyl = base + per_thread * static_cast<size_t>(part);
    float* dxl = dyl + dy_floats;
    for (int64_t b = first; b < last; ++b) {
      to_lanes(dy, s.n, b * kLanes, s.o, PlaneRows::all(s.oh, s.ow), {s.oh, s.ow, 0, 0}, dyl);
      data_grad_block(s, dyl, wt, dxl);
      from_lanes(dxl, s.n, b * kLanes, s.c, PlaneRows::all(s.h, s.w), dx);
    }
  });
}

void lanes_conv_backward_weights(const float* x, const float* dy, float* dw, float* db,
                                 bool accumulate, const ConvGeometry& s) {
  const int64_t blocks = blocks_of(s.n);
  const int nthreads = threads_for(blocks);
  const int64_t weights = s.o * s.c * s.kh * s.kw;
  // Per thread: the padded input block, the gradient block, then the accumulators.
  const size_t x_floats = static_cast<size_t>(s.c * (s.h + 2 * s.pad_h) * (s.w + 2 * s.pad_w) * kLanes);
  const size_t acc_offset = x_floats + static_cast<size_t>(s.o * s.oh * s.ow * kLanes);
  const size_t per_thread = acc_offset + static_cast<size_t>((weights + s.o) * kLanes);
  float* const base = thread_scratch(per_thread * nthreads);
  for_each_part(blocks, nthreads, [&](int part, int64_t first, int64_t last) {
    float* xl = base + per_thread * static_cast<size_t>(part);
    float* dyl = xl + x_floats;
    float* acc = xl + acc_offset;
    std::fill(xl, xl + per_thread, 0.0f);
    for (int64_t b = first; b < last; ++b) {
      to_lanes(x, s.n, b * kLanes, s.c, PlaneRows::all(s.h, s.w),
               {s.h + 2 * s.pad_h, s.w + 2 * s.pad_w, s.pad_h, s.pad_w}, xl);
      to_lanes(dy, s.n, b * kLanes, s.o, PlaneRows::all(s.oh, s.ow), {s.oh, s.ow, 0, 0}, dyl);
      weight_grad_block(s, xl, dyl, acc);
      bias_grad_block(s, dyl, acc + weights * kLanes);
    }
  });
  // acc holds [o][c][kh][kw], the layout of dw, then [o] for db.
  reduce_weight_grads(base, per_thread, nthreads, acc_offset, weights, s.o, dw, db, accumulate);
}

}  // namespace mtrain::ops::cpu
