// Convolution weight gradients as one GEMM over the whole batch.
//
// Note [Weight gradients as a GEMM]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// oneDNN 2.6's direct backward-weights kernel reduces over the batch and the output
// positions; with very few positions per image (ResNet-18's last stage: 512 -> 512,
// 3x3, on 4x4 maps) it runs at less than half the speed of the forward kernel on the
// same shape: 73 ms against 33 ms per call at batch 64, 1 thread, on the 2-core
// AVX-512 VM (from DNNL_VERBOSE in training; the reorders of its inputs come on top).
// Written as a matrix product, the same gradient is
//   dw[o, (c,kh,kw)] = sum over (n, oh, ow) of dy[n,o,oh,ow] * x_pad[n,c,oh*s+kh,ow*s+kw]
//                    = DY[o, (n,p)] @ ROWS[(n,p), (c,kh,kw)]
// with ROWS the input patch of every output position (im2row) and DY the gradient
// with the batch moved inside each channel's row. One sgemm of 512 x 4608 x 1024 does
// the whole batch: 48.8 ms including building ROWS (19 MB) and DY, against the 73 ms.
// At 7x7 positions (256 -> 256) the product measured 43 ms against oneDNN's 35 ms, and
// for the stride-2 4x4 layer (256 -> 512) both took 25 ms, so gemm_weights_applies()
// keeps this to stride 1 and at most 16 output positions per image. db is the row sum
// of DY.
//
// ROWS is built and multiplied a block of input channels at a time: each block gives
// its own columns of dw (the product has no sum across them), so the blocks only
// change how much of ROWS exists at once, not the arithmetic of any element. ResNet-18's
// last stage runs these at the start of backward, when every saved activation is still
// held, so ROWS whole (19 MB at batch 64) added its size to the run's peak memory.
// Blocks of at most kRowsBudget bytes (4 MiB: 113 of the 512 channels) cost nothing
// measurable: 5 products of 512 x 1017 x 1024 instead of one of 512 x 4608 x 1024.
// ROWS and DY live in scratch tensors from the caching allocator.
#include "tensor/cpu/conv_gemm_weights.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "tensor/cpu/dnnl_support.h"
#include "tensor/tensor.h"

namespace mtrain::ops::cpu {
namespace {

constexpr int64_t kMaxPositions = 16;

// rows[(n,p), (c-c0,kh,kw)] = x_pad[n, c, oh*s+kh-pad, ow*s+kw-pad] for the channels
// c0 <= c < c1, zero outside x.
void build_rows(const float* x, float* rows, int64_t c0, int64_t c1, const ConvGeometry& s) {
  const int64_t positions = s.oh * s.ow;
  const int64_t width = (c1 - c0) * s.kh * s.kw;
#pragma omp parallel for if (s.n > 1)
  for (int64_t n = 0; n < s.n; ++n) {
    for (int64_t oh = 0; oh < s.oh; ++oh) {
      for (int64_t ow = 0; ow < s.ow; ++ow) {
        float* row = rows + (n * positions + oh * s.ow + ow) * width;
        for (int64_t c = c0; c < c1; ++c) {
          const float* plane = x + (n * s.c + c) * s.h * s.w;
          for (int64_t kh = 0; kh < s.kh; ++kh) {
            const int64_t ih = oh * s.stride_h - s.pad_h + kh;
            for (int64_t kw = 0; kw < s.kw; ++kw) {
              const int64_t iw = ow * s.stride_w - s.pad_w + kw;
              *row++ = ih >= 0 && ih < s.h && iw >= 0 && iw < s.w ? plane[ih * s.w + iw] : 0.0f;
            }
          }
        }
      }
    }
  }
}

}  // namespace

bool gemm_weights_applies(const ConvGeometry& s) {
  return s.stride_h == 1 && s.stride_w == 1 && s.oh * s.ow <= kMaxPositions && s.n > 0 &&
         s.c > 0 && s.o > 0;
}

void gemm_conv_backward_weights(const float* x, const float* dy, float* dw, float* db,
                                bool accumulate, const ConvGeometry& s, size_t rows_budget) {
  const int64_t positions = s.oh * s.ow;
  const int64_t samples = s.n * positions;  // the reduction length
  const int64_t kernel = s.kh * s.kw;
  const int64_t width = s.c * kernel;
  Tensor dy_scratch = Tensor::empty({s.o * samples});
  float* dy_rows = dy_scratch.data<float>();  // DY[o, (n,p)]
  for (int64_t n = 0; n < s.n; ++n) {
    for (int64_t o = 0; o < s.o; ++o) {
      std::memcpy(dy_rows + o * samples + n * positions, dy + (n * s.o + o) * positions,
                  static_cast<size_t>(positions) * sizeof(float));
    }
  }
  const size_t channel_bytes = static_cast<size_t>(samples * kernel) * sizeof(float);
  const int64_t block = std::clamp<int64_t>(static_cast<int64_t>(rows_budget / channel_bytes), 1, s.c);
  Tensor rows_scratch = Tensor::empty({samples * block * kernel});
  float* rows = rows_scratch.data<float>();
  for (int64_t c0 = 0; c0 < s.c; c0 += block) {
    const int64_t c1 = std::min(s.c, c0 + block);
    build_rows(x, rows, c0, c1, s);
    sgemm(false, false, s.o, (c1 - c0) * kernel, samples, 1.0f, dy_rows, rows,
          accumulate ? 1.0f : 0.0f, dw + c0 * kernel, width);
  }
  if (db) {
    for (int64_t o = 0; o < s.o; ++o) {
      double sum = 0.0;
      const float* r = dy_rows + o * samples;
      for (int64_t i = 0; i < samples; ++i) sum += r[i];
      db[o] = (accumulate ? db[o] : 0.0f) + static_cast<float>(sum);
    }
  }
}

}  // namespace mtrain::ops::cpu
