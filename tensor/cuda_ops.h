// The GPU kernels behind tensor/ops.h, behind a CUDA-free interface.
//
// Note [Kernel dispatch]
// ~~~~~~~~~~~~~~~~~~~~~~
// Layers call one kernel API, tensor/ops.h, whatever the device. Each ops:: function
// looks at its first tensor argument: on a GPU it forwards to the function of the same
// name and signature here, before any CPU check, so the layers, the reducer and the
// optimizer have no second code path (PyTorch's dispatcher, reduced to one `if`).
// These functions check that every tensor is defined, float32 (Int32 argmax, Int64
// labels), contiguous and on the *same* GPU as the first one, and throw InternalError
// naming the op, the argument and what was found otherwise: a layer that mixes devices
// is a bug in mtrain, and the CPU kernels would read device pointers as host memory.
//
// Every kernel is queued on the current stream of its device (Note [Current stream]
// in tensor/cuda/stream.h) and returns without waiting for it, except the ones that
// return a host value (cross_entropy, count_correct), which wait for their own result.
// Convolutions run on cuDNN and matrix products on cuBLAS, with one handle per device
// and thread bound to the current stream; the rest are mtrain's own CUDA kernels
// (tensor/cuda/*.cu). Numerics follow the CPU kernels' definitions in ops.h, in float32
// with float32 (or wider) accumulation.
//
// In builds without CUDA (MTRAIN_HAVE_CUDA unset) tensor/no_cuda.cpp defines each
// function to throw InvalidArgument saying the build has no CUDA; no GPU tensor can
// exist there, so they are never reached through the dispatch.
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
// and linear. The GPU-against-CPU tests turn both off.
struct NumericsOptions {
  bool cudnn_benchmark = false;
  bool deterministic = false;
  bool allow_tf32 = true;
  bool allow_tf32_matmul = false;
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
// as on the CPU. bfloat16 needs compute capability 8.0 (Ampere) or newer and float16
// 7.0, which compute_dtype_supported checks.
bool compute_dtype_supported(DType compute, Device device);
void convert(const Tensor& src, Tensor& dst);

// ---- elementwise ------------------------------------------------------------------
void add(const Tensor& a, const Tensor& b, Tensor& out);
void add_(Tensor& out, const Tensor& a, float alpha);
void scale_(Tensor& x, float alpha);
void relu_forward(const Tensor& x, Tensor& y);
void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx);
void sigmoid_forward(const Tensor& x, Tensor& y);
void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx);

// ---- matrix multiply (cuBLAS) -------------------------------------------------------
void matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& c,
            float alpha, float beta);
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y, DType compute);
void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw,
                     Tensor& db, bool accumulate, DType compute);

// ---- convolution (cuDNN) ------------------------------------------------------------
void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                    const ops::Conv2dParams& p);
void conv2d_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx, const ops::Conv2dParams& p);
void conv2d_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db,
                             const ops::Conv2dParams& p, bool accumulate);

// ---- pooling --------------------------------------------------------------------------
void maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const ops::Pool2dParams& p);
void maxpool2d_backward(const Tensor& dy, const Tensor& indices, Tensor& dx);
void avgpool2d_forward(const Tensor& x, Tensor& y, const ops::Pool2dParams& p);
void avgpool2d_backward(const Tensor& dy, Tensor& dx, const ops::Pool2dParams& p);
void global_avgpool_forward(const Tensor& x, Tensor& y);
void global_avgpool_backward(const Tensor& dy, Tensor& dx);

// ---- batch norm (Note [Separable batch norm] in ops.h) ---------------------------------
void batchnorm_stats(const Tensor& x, Tensor& mean, Tensor& var);
void batchnorm_apply(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                     const Tensor& gamma, const Tensor& beta, Tensor& y);
void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               Tensor& sum_dy, Tensor& sum_dy_xmu);
void batchnorm_backward_apply(const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& invstd, const Tensor& gamma, const Tensor& sum_dy,
                              const Tensor& sum_dy_xmu, double count, Tensor& dx);

void batchnorm_invstd(const Tensor& var, double eps, Tensor& invstd);
void batchnorm_update_running(const Tensor& mean, const Tensor& var, int64_t count,
                              double momentum, Tensor& running_mean, Tensor& running_var,
                              Tensor& num_batches_tracked);
void batchnorm_param_grads(const Tensor& sum_dy, const Tensor& sum_dy_xmu, const Tensor& invstd,
                           Tensor& dgamma, Tensor& dbeta);
void batchnorm_merge_stats(const Tensor& rows, Tensor& mean, Tensor& var);

// ---- loss -------------------------------------------------------------------------------
// A label outside [0, K) is detected on the device and reported (InvalidArgument naming
// the first bad row and label) when the result is read back, as the CPU kernel does.
double cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& dlogits, float grad_scale);
int64_t count_correct(const Tensor& logits, const Tensor& labels);

// ---- optimizer ----------------------------------------------------------------------------
void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
              float dampening, float weight_decay, bool nesterov, bool first_step);
void sgd_step_all(const std::vector<ops::SgdParamRef>& params, float lr, float momentum,
                  float dampening, float weight_decay, bool nesterov, bool first_step);
bool non_finite_check_and_unscale(const std::vector<Tensor*>& grads, float inv_scale);

}  // namespace mtrain::cuda_ops
