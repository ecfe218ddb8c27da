// Building blocks shared by the own CPU convolution kernels (conv_direct.cpp,
// conv_lanes.cpp): a 16-float vector type compiled for the best instruction set the
// CPU has, per-thread scratch, and the fixed split of a batch across OpenMP threads.
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

// Items [split(items, i, n), split(items, i + 1, n)) belong to thread i of n: a fixed
// split, so results depend only on the thread count.
inline int64_t split(int64_t items, int i, int n) { return items * i / n; }

}  // namespace mtrain::ops::cpu
