// The process-wide numerics settings of the GPU kernels (Note [Convolution algorithm
// choice] in tensor/cuda_ops.h).
//
// Every convolution and matrix product reads them, possibly from several threads while
// the trainer sets them, so they live in one atomic word: a reader always sees one
// complete set of flags, never half of an update, and pays no lock.
#include <atomic>
#include <cstdint>

#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

enum NumericsBit : uint32_t {
  kCudnnBenchmark = 1u << 0,
  kDeterministic = 1u << 1,
  kAllowTf32 = 1u << 2,
  kAllowTf32Matmul = 1u << 3,
  kBatchnormOnePass = 1u << 4,
  kCudnnGraphApi = 1u << 5,
};

constexpr uint32_t pack(const NumericsOptions& o) {
  return (o.cudnn_benchmark ? kCudnnBenchmark : 0u) | (o.deterministic ? kDeterministic : 0u) |
         (o.allow_tf32 ? kAllowTf32 : 0u) | (o.allow_tf32_matmul ? kAllowTf32Matmul : 0u) |
         (o.batchnorm_one_pass ? kBatchnormOnePass : 0u) | (o.cudnn_graph_api ? kCudnnGraphApi : 0u);
}

NumericsOptions unpack(uint32_t bits) {
  NumericsOptions o;
  o.cudnn_benchmark = (bits & kCudnnBenchmark) != 0;
  o.deterministic = (bits & kDeterministic) != 0;
  o.allow_tf32 = (bits & kAllowTf32) != 0;
  o.allow_tf32_matmul = (bits & kAllowTf32Matmul) != 0;
  o.batchnorm_one_pass = (bits & kBatchnormOnePass) != 0;
  o.cudnn_graph_api = (bits & kCudnnGraphApi) != 0;
  return o;
}

// Starts at NumericsOptions' defaults (PyTorch's); constant-initialised, so code running
// during static initialisation sees them too.
constinit std::atomic<uint32_t> g_numerics{pack(NumericsOptions{})};

}  // namespace

void set_numerics(const NumericsOptions& options) {
  g_numerics.store(pack(options), std::memory_order_relaxed);
}

NumericsOptions numerics() { return unpack(g_numerics.load(std::memory_order_relaxed)); }

}  // namespace mtrain::cuda_ops
