// Building blocks shared by the own CPU convolution kernels (conv_direct.cpp,
// conv_lanes.cpp, conv_winograd.cpp): a 16-float vector type compiled for the best
// instruction set the CPU has, per-thread scratch, the fixed split of a batch across
// OpenMP threads, and the copies into and out of the lanes layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mtrain::ops::cpu {

constexpr int64_t kLanes = 16;

// GCC's vector extension: one AVX-512 register, two AVX2 registers, or four SSE ones.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

// Compiles a kernel for AVX-512, AVX2 and the baseline; the loader picks the best one
// the CPU has (the project builds without -march).
#define MTRAIN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

[[gnu::always_inline]] inline void load(Vec& v, const float* p) { std::memcpy(&v, p, sizeof v); }
[[gnu::always_inline]] inline void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// A buffer of at least `floats` floats owned by the calling thread and reused across
// calls (no allocation in the steady state). Kernels carve per-OpenMP-thread parts out
// of it before their parallel region.
float* thread_scratch(size_t floats);

// How many OpenMP threads to use for `items` independent items (at least one).
int threads_for(int64_t items);

// Sixteen images in the vector lanes (Note [Images in the vector lanes] in
// conv_lanes.cpp). Rows [first, first + count) of the h x w planes of images
// [n0, n0 + 16) of a tensor t[n, channels, h, w] ...
struct PlaneRows {
  int64_t h, w, first, count;
  static PlaneRows all(int64_t h, int64_t w) { return {h, w, 0, h}; }
};
// ... go to dst[channel][(r - first + top) * row + col + left][16]: planes of
// `rows` x `row` pixels that hold those rows with a border (top + count <= rows,
// left + w <= row).
struct LanesFrame {
  int64_t rows, row, top, left;
};

// Lanes past the end of the batch are zero; the border is left as it is (the caller
// zeroes it).
void to_lanes(const float* t, int64_t n, int64_t n0, int64_t channels, PlaneRows src, LanesFrame frame,
              float* dst);

// The inverse without a border: src[channel][(r - first) * w + col][16] goes to rows
// [first, first + count) of t's planes, for the images of the block that exist.
void from_lanes(const float* src, int64_t n, int64_t n0, int64_t channels, PlaneRows dst, float* t);

// Items [split(items, i, n), split(items, i + 1, n)) belong to thread i of n: a fixed
// split, so results depend only on the thread count.
inline int64_t split(int64_t items, int i, int n) { return items * i / n; }

}  // namespace mtrain::ops::cpu
