#include "tensor/cpu/threading.h"

#include <omp.h>

#include <atomic>

#include "core/error.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

// Default: what OpenMP would use (OMP_NUM_THREADS or the core count).
std::atomic<int>& configured_threads() {
  static std::atomic<int> n{omp_get_max_threads()};
  return n;
}

}  // namespace

void set_num_threads(int n) {
  if (n < 1) throw InvalidArgument(fmt::format("number of threads must be >= 1, got {}", n));
  configured_threads().store(n, std::memory_order_relaxed);
  cpu::use_configured_threads();
}

int num_threads() { return configured_threads().load(std::memory_order_relaxed); }

namespace cpu {

// Note [Thread count]
// ~~~~~~~~~~~~~~~~~~~
// oneDNN here is built on the OpenMP runtime, so it sizes its parallel regions with
// omp_get_max_threads() of the calling thread. That value is a per-thread OpenMP
// setting: omp_set_num_threads() in main does not reach a data-loader or reducer
// thread. set_num_threads() therefore stores the wanted count process-wide, and every
// kernel entry point calls use_configured_threads(), which re-applies it to the calling
// thread only when that thread's applied value is stale (one thread_local compare in
// the steady state).
void use_configured_threads() {
  thread_local int applied = 0;
  const int wanted = num_threads();
  if (applied != wanted) {
    omp_set_num_threads(wanted);
    applied = wanted;
  }
}

}  // namespace cpu
}  // namespace mtrain::ops
