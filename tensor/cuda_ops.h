// The GPU kernels behind tensor/ops.h: the CUDA entry of every op in tensor/ops.def,
// declared from that table, and the numerics settings they read. CUDA-free: a build
// without CUDA defines each entry in tensor/no_cuda.cpp to throw InvalidArgument saying
// the build has no CUDA.
//
// ops:: runs these for GPU tensors (Note [Kernel dispatch] in tensor/ops.cpp). Each checks
// that every tensor is defined, float32 (Int32 argmax, Int64 labels) and on the *same*
// GPU as the first one, and throws InternalError naming the op, the argument and what
// was found otherwise. Every kernel is queued on the current stream of its device (Note
// [Current stream] in tensor/cuda/stream.h) and returns without waiting for it, except
// the ones that return a host value (cross_entropy, count_correct,
// non_finite_check_and_unscale), which wait for their own result. Convolutions run on cuDNN and matrix products on cuBLAS, with one handle
// per device and thread bound to the current stream; the rest are mtrain's own CUDA
// kernels (tensor/cuda/*.cu). Numerics follow the CPU kernels' definitions in ops.h, in
// float32 with float32 (or wider) accumulation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace mtrain::cuda_ops {

// ---- numerics settings (process-wide; set before training starts) -----------------

// Note [Convolution algorithm choice]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// As PyTorch's torch.backends.cudnn flags, with the same defaults:
//   benchmark = false: cuDNN's heuristics pick the algorithm (cudnnGet*_v7), no trial runs;
//   benchmark = true:  the first call for a shape times every algorithm (cudnnFind*),
//                      the fastest that fits the workspace limit is cached for that shape;
//   deterministic:     only algorithms cuDNN documents as deterministic (bitwise the same
//                      on every run); combined with benchmark, the fastest of those.
// allow_tf32 (convolutions; PyTorch's cudnn.allow_tf32, default true) lets cuDNN use
// TF32 tensor cores for float32 (10-bit mantissa products). allow_tf32_matmul (cuBLAS;
// PyTorch's cuda.matmul.allow_tf32, default false since 1.12) does the same for matmul
// and linear. The GPU-against-CPU tests turn both off. batchnorm_one_pass computes
// batch-norm statistics in one read of the input (Note [One-pass batch-norm statistics]
// in tensor/cuda/batchnorm.cu) instead of two; cudnn_graph_api runs convolutions on
// cuDNN's graph API, where it has an engine for them (Note [Convolutions on the graph
// API] in tensor/cuda/cudnn_graph.cpp), instead of the legacy API.
struct NumericsOptions {
  bool cudnn_benchmark = false;
  bool deterministic = false;
  bool allow_tf32 = true;
  bool allow_tf32_matmul = false;
  bool batchnorm_one_pass = false;
  bool cudnn_graph_api = false;
  // (Spelled out: .cu files are compiled as C++17, which has no defaulted ==.)
  bool operator==(const NumericsOptions& o) const {
    return cudnn_benchmark == o.cudnn_benchmark && deterministic == o.deterministic &&
           allow_tf32 == o.allow_tf32 && allow_tf32_matmul == o.allow_tf32_matmul &&
           batchnorm_one_pass == o.batchnorm_one_pass && cudnn_graph_api == o.cudnn_graph_api;
  }
};
void set_numerics(const NumericsOptions& options);
NumericsOptions numerics();

// ---- reduced precision (Note [Reduced-precision compute] in ops.h) -------------------
// Note [16-bit kernels on the GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With compute = BFloat16 or Float16 the GPU kernels convert their float32 operands into
// 16-bit scratch tensors from the caching allocator (one elementwise kernel each), run
// cuDNN's convolution in its PSEUDO_BFLOAT16 / PSEUDO_HALF configuration (16-bit x, w
// and y, float32 arithmetic) or cuBLAS's cublasGemmEx (16-bit A and B, float32 C and
// compute type), and convert 16-bit results back into the float32 outputs (adding into
// them where the gradient accumulates). cuDNN's legacy API writes y, dx and dw in the
// data type of x, so on a GPU a convolution's outputs are rounded to 16 bits once more
// (as under torch.autocast, whose convolutions return 16-bit tensors); cuBLAS writes
// float32. The bias and both layers' bias gradients are float32 (from the float32 dy),
// as on the CPU. With 16-bit activations (Note [16-bit activations] in ops.h) a
// convolution's x, y, dy and dx may already be 16-bit tensors: one in the compute type
// goes to cuDNN as it is, with no conversion; the bias is added to the 16-bit output in
// float32 arithmetic and its gradient summed from the 16-bit dy in double, in a fixed order. bfloat16 needs compute
// capability 8.0 (Ampere) or newer and float16 7.0, which compute_dtype_supported checks.

// ---- the CUDA entry of every op in tensor/ops.def -----------------------------------------
// cross_entropy and count_correct detect a label outside [0, K) on the device and report it
// (InvalidArgument naming the first bad row and label) when the result is read back, as the
// CPU kernels do; loss_stats leaves the row in its result for its reader.
#define MTRAIN_OP(RETURN, NAME, PARAMS, ARGS, DEVICE, WITHOUT_CUDA) RETURN NAME PARAMS;
#include "tensor/ops.def"
#undef MTRAIN_OP

}  // namespace mtrain::cuda_ops
