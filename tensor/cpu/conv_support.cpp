#include "tensor/cpu/conv_support.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace mtrain::ops::cpu {
namespace {

typedef int32_t Index __attribute__((vector_size(kLanes * sizeof(int32_t))));

// One stage of a 16x16 transpose: rows a and b = a + B swap the B x B blocks off the
// diagonal. After the stages for B = 8, 4, 2 and 1, row r holds what column r held.
template <int B>
[[gnu::always_inline]] inline void swap_blocks(Vec& a, Vec& b) {
  static constexpr Index kLow = B == 8   ? Index{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}
                                : B == 4 ? Index{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}
                                : B == 2 ? Index{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}
                                         : Index{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  static constexpr Index kHigh = kLow + B;
  const Vec low = __builtin_shuffle(a, b, kLow);
  b = __builtin_shuffle(a, b, kHigh);
  a = low;
}

[[gnu::always_inline]] inline void transpose16(Vec (&r)[kLanes]) {
  for (int i = 0; i < 16; ++i) if (!(i & 8)) swap_blocks<8>(r[i], r[i + 8]);
  for (int i = 0; i < 16; ++i) if (!(i & 4)) swap_blocks<4>(r[i], r[i + 4]);
  for (int i = 0; i < 16; ++i) if (!(i & 2)) swap_blocks<2>(r[i], r[i + 2]);
  for (int i = 0; i < 16; ++i) if (!(i & 1)) swap_blocks<1>(r[i], r[i + 1]);
}

}  // namespace

float* thread_scratch(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

int threads_for(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), items)));
}

// Sixteen pixels of sixteen images at a time are transposed in registers.
MTRAIN_CLONES void to_lanes(const float* t, int64_t n, int64_t n0, int64_t channels, PlaneRows src,
                            LanesFrame frame, float* dst) {
  const int64_t plane = frame.rows * frame.row;
  const int64_t hw = src.h * src.w;       // channel stride of t
  const int64_t pixels = src.count * src.w;  // copied per plane
  const int64_t lanes = std::min(kLanes, n - n0);
  for (int64_t ch = 0; ch < channels; ++ch) {
    // Lane l reads from in + l * channels * hw.
    const float* in = t + (n0 * channels + ch) * hw + src.first * src.w;
    float* const out = dst + (ch * plane + frame.top * frame.row + frame.left) * kLanes;
    int64_t r = 0, col = 0;  // of pixel p
    auto next = [&] {        // the destination of pixel p, then on to pixel p + 1
      float* at = out + (r * frame.row + col) * kLanes;
      if (++col == src.w) col = 0, ++r;
      return at;
    };
    int64_t p = 0;
    for (; p + kLanes <= pixels; p += kLanes) {
      Vec v[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) {
        if (l < lanes) {
          load(v[l], in + l * channels * hw + p);
        } else {
          v[l] = Vec{};
        }
      }
      transpose16(v);
      for (int64_t q = 0; q < kLanes; ++q) store(next(), v[q]);
    }
    for (; p < pixels; ++p) {
      float* at = next();
      for (int64_t l = 0; l < kLanes; ++l) at[l] = l < lanes ? in[l * channels * hw + p] : 0.0f;
    }
  }
}

MTRAIN_CLONES void from_lanes(const float* src, int64_t n, int64_t n0, int64_t channels, PlaneRows dst,
                              float* t) {
  const int64_t hw = dst.h * dst.w;
  const int64_t pixels = dst.count * dst.w;
  const int64_t lanes = std::min(kLanes, n - n0);
  for (int64_t ch = 0; ch < channels; ++ch) {
    const float* in = src + ch * pixels * kLanes;
    // Lane l writes to out + l * channels * hw.
    float* out = t + (n0 * channels + ch) * hw + dst.first * dst.w;
    int64_t p = 0;
    for (; p + kLanes <= pixels; p += kLanes) {
      Vec r[kLanes];
      for (int64_t q = 0; q < kLanes; ++q) load(r[q], in + (p + q) * kLanes);
      transpose16(r);
      for (int64_t l = 0; l < lanes; ++l) store(out + l * channels * hw + p, r[l]);
    }
    for (; p < pixels; ++p) {
      for (int64_t l = 0; l < lanes; ++l) out[l * channels * hw + p] = in[p * kLanes + l];
    }
  }
}

}  // namespace mtrain::ops::cpu
