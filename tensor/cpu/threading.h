// Intra-op thread control shared by the OpenMP loops and oneDNN.
//
// Note [Thread count]
// ~~~~~~~~~~~~~~~~~~~
// oneDNN here is built on the OpenMP runtime, so it sizes its parallel regions with
// omp_get_max_threads() of the calling thread. That value is a per-thread OpenMP
// setting: omp_set_num_threads() in main does not reach a data-loader or reducer
// thread. set_num_threads() therefore stores the wanted count process-wide, and every
// kernel entry point calls use_configured_threads(), which re-applies it to the calling
// thread only when that thread's applied value is stale (one thread_local compare in
// the steady state).
#pragma once

namespace mtrain::ops::cpu {

void use_configured_threads();

}  // namespace mtrain::ops::cpu
