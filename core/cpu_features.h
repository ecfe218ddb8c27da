// Which vector instructions this CPU runs, for kernels compiled more than once. The project
// builds without -march (one binary for every x86-64 machine), so a hot loop that gains from
// wider vectors is cloned per instruction set and the loader picks the best clone the CPU has.
#pragma once

namespace mtrain {

// Compiles a function for AVX-512, the x86-64-v3 level (AVX2 with FMA; "avx2" alone would
// leave out FMA) and the baseline; the loader picks the best one the CPU has. Not
// "arch=haswell": GCC dispatches an arch= clone by CPU model, so it would run on Intel
// Haswell only and every AMD or later Intel CPU without AVX-512 would get the SSE2
// baseline; x86-64-v3 is dispatched by CPU features.
#define MTRAIN_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))

// Whether the CPU has what the avx512f clone needs, and what the x86-64-v3 one (AVX2 with
// FMA) needs; the loader takes the first clone the CPU can run.
bool cpu_has_avx512();
bool cpu_has_x86_64_v3();

}  // namespace mtrain
