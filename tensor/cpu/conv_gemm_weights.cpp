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
// of DY. ROWS and DY live in one scratch tensor from the caching allocator.
#include "tensor/cpu/conv_gemm_weights.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "tensor/cpu/dnnl_support.h"
#include "tensor/tensor.h"

namespace mtrain::ops::cpu {
namespace {

constexpr int64_t kMaxPositions = 16;

// rows[(n,p), (c,kh,kw)] = x_pad[n, c, oh*s+kh-pad, ow*s+kw-pad], zero outside x.
void build_rows(const float* x, float* rows, const ConvGeometry& s) {
  const int64_t positions = s.oh * s.ow;
  const int64_t width = s.c * s.kh * s.kw;
#pragma omp parallel for if (s.n > 1)
  for (int64_t n = 0; n < s.n; ++n) {
    for (int64_t oh = 0; oh < s.oh; ++oh) {
      for (int64_t ow = 0; ow < s.ow; ++ow) {
        float* row = rows + (n * positions + oh * s.ow + ow) * width;
        for (int64_t c = 0; c < s.c; ++c) {
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
                                bool accumulate, const ConvGeometry& s) {
  const int64_t positions = s.oh * s.ow;
  const int64_t samples = s.n * positions;  // the reduction length
  const int64_t width = s.c * s.kh * s.kw;
  Tensor scratch = Tensor::empty({samples * width + s.o * samples});
  float* rows = scratch.data<float>();
  float* dy_rows = rows + samples * width;  // DY[o, (n,p)]
  build_rows(x, rows, s);
  for (int64_t n = 0; n < s.n; ++n) {
    for (int64_t o = 0; o < s.o; ++o) {
      std::memcpy(dy_rows + o * samples + n * positions, dy + (n * s.o + o) * positions,
                  static_cast<size_t>(positions) * sizeof(float));
    }
  }
  sgemm(false, false, s.o, width, samples, 1.0f, dy_rows, rows, accumulate ? 1.0f : 0.0f, dw);
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
