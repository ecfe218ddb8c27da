// Building blocks shared by the own CPU convolution kernels (conv_direct.cpp,
// conv_lanes.cpp, conv_winograd.cpp): a 16-float vector type compiled for the best
// instruction set the CPU has (MTRAIN_CLONES, core/cpu_features.h), per-thread scratch,
// the fixed split of a batch across OpenMP threads, and the copies into and out of the
// lanes layout.
#pragma once

#include <omp.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>

#include "core/cpu_features.h"

namespace mtrain::ops::cpu {

constexpr int64_t kLanes = 16;

// GCC's vector extension: one AVX-512 register, two AVX2 registers, or four SSE ones.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

[[gnu::always_inline]] inline void load(Vec& v, const float* p) { std::memcpy(&v, p, sizeof v); }
[[gnu::always_inline]] inline void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// A buffer of at least `floats` floats owned by the calling thread and reused across
// calls (no allocation in the steady state). Kernels carve per-OpenMP-thread parts out
// of it before their parallel region.
float* thread_scratch(size_t floats);

// The clones' CPU tests (core/cpu_features.h), named where the kernels' rules use them.
using mtrain::cpu_has_avx512;
using mtrain::cpu_has_x86_64_v3;

// How many OpenMP threads to use for `items` independent items (at least one).
int threads_for(int64_t items);

// Blocks of kLanes images in a batch of n.
inline int64_t blocks_of(int64_t n) { return (n + kLanes - 1) / kLanes; }

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

// Items [split(items, i, n), split(items, i + 1, n)) belong to part i of n: a fixed
// split, so results depend only on the number of parts.
inline int64_t split(int64_t items, int i, int n) { return items * i / n; }

// Runs body(part, first, last) for every part of `parts` fixed parts of [0, items) on
// an OpenMP team of up to `parts` threads. OpenMP may give fewer threads than asked
// (OMP_THREAD_LIMIT, OMP_DYNAMIC, a call from inside another parallel region); the
// team's threads then run the missing parts too, so every item is processed and the
// result still depends only on `parts`. A kernel keeps its per-part state (scratch,
// partial sums) by part number, not by thread number. The first exception a part
// throws is rethrown on the calling thread once the region has ended.
template <class Body>
void for_each_part(int64_t items, int parts, Body&& body) {
  std::exception_ptr error;
#pragma omp parallel num_threads(parts) if (parts > 1)
  for (int part = omp_get_thread_num(); part < parts; part += omp_get_num_threads()) {
    try {
      body(part, split(items, part, parts), split(items, part + 1, parts));
    } catch (...) {
#pragma omp critical(mtrain_for_each_part_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace mtrain::ops::cpu
