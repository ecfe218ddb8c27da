// The kernels behind the layers, one API for both devices: each op runs on the device of
// its tensors (Note [Kernel dispatch] in tensor/ops.cpp). Every function takes
// already-allocated outputs of the right shape (so the caller controls memory reuse) and
// checks shapes, throwing InternalError naming the op and the shapes on a mismatch.
//
// Layout: activations are NCHW float32, contiguous; conv weights are OIHW; linear
// weights are [out, in] (PyTorch's layouts, so weights load into torch unchanged).
//
// Note [Gradient accumulation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Kernels that produce *parameter* gradients take `accumulate`: when true they add
// into the existing gradient (PyTorch semantics: gradients accumulate until
// zero_grad), when false they overwrite. Input gradients (dx) are always overwritten.
//
// Note [Separable batch norm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Batch norm is split into statistics and application so SyncBatchNorm can replace
// the local statistics with global ones (all-gathered mean/invstd/count forward,
// all-reduced sum_dy/sum_dy_xmu backward) and reuse the same kernels:
//   forward:  batchnorm_stats -> [merge across ranks] -> batchnorm_apply
//   backward: batchnorm_backward_reduce -> [all-reduce] -> batchnorm_backward_apply
// Eval mode uses running statistics with batchnorm_apply, and its backward is
// batchnorm_backward_apply with sum_dy = sum_dy_xmu = 0.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace mtrain::ops {

// ---- threads -------------------------------------------------------------------
// Intra-op threads for every kernel (OpenMP and oneDNN). n >= 1.
void set_num_threads(int n);
int num_threads();

// ---- elementwise ---------------------------------------------------------------
void add(const Tensor& a, const Tensor& b, Tensor& out);       // out = a + b (out may alias a or b)
void add_(Tensor& out, const Tensor& a, float alpha = 1.0f);   // out += alpha * a
void scale_(Tensor& x, float alpha);                           // x *= alpha
void relu_forward(const Tensor& x, Tensor& y);
void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx);      // uses the output y
void sigmoid_forward(const Tensor& x, Tensor& y);
void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx);   // dx = dy * y * (1 - y)
// out = a * b, elementwise (out may alias a or b).
void mul(const Tensor& a, const Tensor& b, Tensor& out);
// y[n, c, ...] = x[n, c, ...] * s[n, c] for x [N, C, ...] and s of N x C elements ([N, C, 1,
// 1] or [N, C]): a scale per image and channel (squeeze-and-excitation); or s[c] for s of C
// elements, one scale per channel for every image (ConvNeXt's layer scale). y may alias x.
void scale_channels(const Tensor& x, const Tensor& s, Tensor& y);
// out[n, c] = the sum over the rest of a[n, c, ...] * b[n, c, ...], for a and b of one shape
// [N, C, ...] and out of N x C elements; or out[c], the sum over the images too, for out of C
// elements: scale_channels' gradient with respect to s. Sums in double, images in order.
void channel_dot(const Tensor& a, const Tensor& b, Tensor& out);
// What scale_channels and channel_dot work on: N x C planes of `inner` elements each, for x
// [N, C, ...] (float32) and `per_plane` with one float32 element per plane or per channel
// (`values` of them; plane p has value p % values), on x's device. Throws InternalError
// naming the op otherwise.
struct ChannelPlanes {
  int64_t planes = 0, inner = 0, values = 0;
};
ChannelPlanes channel_planes(const char* op, const Tensor& x, const Tensor& per_plane);
// Element i of dropout draw `seed` is kept when this is at least p (a number in [0, 1) with
// 24 random bits: splitmix64 of seed and i). Host and device code.
#ifdef __CUDACC__
__host__ __device__
#endif
inline float dropout_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}
// Fills `mask` (float32) with 0 at probability p and 1 / (1 - p) elsewhere (inverted
// dropout, as torch.nn.Dropout scales). Element i of draw `seed` comes from a counter-based
// generator (splitmix64 of seed and i), so it is the same on every device.
void dropout_mask(Tensor& mask, float p, uint64_t seed);

// The piecewise-linear activations of mobile networks, each with PyTorch's formula and
// rounding (its CPU kernels'); their backward reads the input x.
//   hardtanh:    y = min(max(x, lo), hi)            dx = dy where lo < x < hi, else 0  (ReLU6: 0, 6)
//   hardsigmoid: y = min(max(x + 3, 0), 6) / 6      dx = dy / 6 where -3 < x < 3, else 0
//   hardswish:   y = x * min(max(x + 3, 0), 6) / 6  dx = 0 (x < -3), dy * (x / 3 + 0.5) (x <= 3), dy
void hardtanh_forward(const Tensor& x, float lo, float hi, Tensor& y);
void hardtanh_backward(const Tensor& x, const Tensor& dy, float lo, float hi, Tensor& dx);
void hardsigmoid_forward(const Tensor& x, Tensor& y);
void hardsigmoid_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
void hardswish_forward(const Tensor& x, Tensor& y);
void hardswish_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
// y = x * scale + shift (ONNX's Add, Sub, Mul and Div by a constant number).
void affine(const Tensor& x, float scale, float shift, Tensor& y);
// y = erf(x); dx = dy * 2 / sqrt(pi) * exp(-x^2) (GELU exports as x * (1 + erf(x / sqrt 2)) / 2).
void erf_forward(const Tensor& x, Tensor& y);
void erf_backward(const Tensor& x, const Tensor& dy, Tensor& dx);

// ---- layer normalisation ---------------------------------------------------------
// Each row of x [R, C] normalised over its C values (torch.nn.LayerNorm over the last
// dimension): y = (x - mean) * rstd * w + b with rstd = 1 / sqrt(var + eps), var the biased
// variance; `mean` and `rstd` [R] are kept for the backward. Statistics in double.
void layer_norm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& y, Tensor& mean,
                        Tensor& rstd);
// dx [R, C], and dw and db [C] (overwritten: sums over the rows in row order, so the result
// does not depend on the device's thread count).
void layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& w, const Tensor& mean,
                         const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db);
// Checks the operands of both (InternalError naming the op and what does not fit); returns
// [R, C].
struct LayerNormRows {
  int64_t rows = 0, features = 0;
};
LayerNormRows layer_norm_rows(const char* op, const Tensor& x, const Tensor& w, const Tensor& mean,
                              const Tensor& rstd);

// ---- channel blocks ------------------------------------------------------------
// dst[:, dst_offset : dst_offset + channels] = src[:, src_offset : src_offset + channels],
// for float32 tensors [N, C, ...] on one device with the same N and the same trailing
// dimensions: a concatenation along the channels and its gradient.
void copy_channels(const Tensor& src, int64_t src_offset, Tensor& dst, int64_t dst_offset, int64_t channels);
// What copy_channels copies: `batch` runs of `bytes`, the n-th from src_begin + n * src_pitch
// to dst_begin + n * dst_pitch (offsets in bytes). Throws InternalError, naming the op and
// both tensors, for tensors or a block that do not fit.
struct ChannelBlock {
  int64_t batch = 0;
  size_t bytes = 0;
  size_t src_begin = 0, src_pitch = 0, dst_begin = 0, dst_pitch = 0;
};
ChannelBlock channel_block(const Tensor& src, int64_t src_offset, const Tensor& dst, int64_t dst_offset,
                           int64_t channels);
// y = x with its dimensions reordered, y.shape[d] = x.shape[perm[d]] (torch.permute, made
// contiguous), for float32 tensors of at most kMaxPermuteDims dimensions on one device:
// ONNX's Transpose of activations (ShuffleNet's channel shuffle).
constexpr int kMaxPermuteDims = 6;
void permute(const Tensor& x, const std::vector<int64_t>& perm, Tensor& y);
// What permute reads: y's element at index (i_0, ..., i_rank-1) of `dims` is x's element
// sum of i_d * x_strides[d]. Throws InternalError, naming both tensors, for a `perm` that is
// no permutation of x's dimensions or a y of another shape.
struct PermutePlan {
  int rank = 0;
  int64_t count = 0;
  int64_t dims[kMaxPermuteDims] = {};
  int64_t x_strides[kMaxPermuteDims] = {};
};
PermutePlan permute_plan(const Tensor& x, const std::vector<int64_t>& perm, const Tensor& y);

// Note [Reduced-precision compute]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Convolutions and linear layers take a `compute` dtype (--amp, Note [Mixed precision]
// in models/mixed_precision.h). Float32 is the plain kernel. With BFloat16 or Float16 the
// float32 inputs that are multiplied (x and w forward, dy and w for dx, x and dy for dw)
// are rounded to that type (to nearest even) and multiplied with float32 accumulation;
// every output (y, dx, dw, db) and the bias stay float32 tensors, so the layers around
// them, and the optimizer's master weights, never see the 16-bit type. db sums the
// float32 dy. A product of two 16-bit values is exact in float32, so the result equals
// the float32 kernel applied to the rounded inputs up to summation order; on a GPU,
// convolution outputs also pass through the 16-bit type (Note [16-bit kernels on the
// GPU] in cuda_ops.h). The 16-bit products are computed by oneDNN's 16-bit convolutions
// where it has them for the CPU (bf16 on AVX-512; f16 nowhere in oneDNN 2.6, not even with
// AVX512_FP16), except the shapes mtrain's own float32 kernels take, which run on rounded
// operands (Note [Own kernels under --amp] in tensor/cpu/conv.cpp); by sgemm on rounded
// operands in the CPU's linear layers; and by cuDNN and cuBLAS on GPUs.
// compute_dtype_supported says which apply here.
bool compute_dtype_supported(DType compute, Device device);
// The library that runs the CPU's convolutions and its version, for messages: "oneDNN 2.6.3".
std::string cpu_convolution_library();
// Rounds every element of float32 `x` to the nearest `to` value (BFloat16 or Float16,
// ties to even; Float16 overflows to infinity) and stores it as float32 in `y` (may
// alias x). The CPU reference of the rounding above, used by the CPU linear layers and
// the own convolution kernels.
void round_to_dtype(const Tensor& x, DType to, Tensor& y);
// dst = src converted elementwise between float32 and a 16-bit type (either way; same
// numel, same device), rounding to nearest even as round_to_dtype does. For gradient
// compression (Note [Gradient compression] in trainer/ddp/reducer.h).
void convert(const Tensor& src, Tensor& dst);

// Note [16-bit activations]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Any op's activation tensors (its inputs, outputs and their gradients; not parameters,
// their gradients, per-channel statistics or the tensors of a list, which stay float32)
// may be stored as bfloat16 or float16, as torch.autocast passes them between layers
// (MTRAIN_SPEEDUPS=amp-activations, Note [Mixed precision] in models/mixed_precision.cpp).
// Storage only: every op computes in float32, as on float32 tensors, and rounds each
// 16-bit output once, to nearest even; the exception is a GPU convolution in a 16-bit
// compute type with a bias, whose 16-bit cuDNN output is rounded again after the bias
// add, as autocast's is. The GPU entries of the ops that carry a step's traffic
// (convolutions, batch norm, add, ReLU) read and write 16 bits themselves; for every other
// op, and every CPU entry, the dispatcher (tensor/ops.cpp) runs the float32 kernel on
// widened copies and rounds the outputs back into their 16-bit tensors: the same numbers,
// at the cost of the copies. Those GPU entries take one storage type per call for the
// tensors of their first tensor's shape (x, y, dy, dx, a residual), checked on every
// device so that a layer that mixes them fails on the CPU too; convolutions take each of
// x, y, dy, dx in float32 or 16 bits.

// ---- matrix multiply -------------------------------------------------------------
// c = alpha * op(a) @ op(b) + beta * c, 2-D float32; op(t) = t or t^T.
void matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& c,
            float alpha = 1.0f, float beta = 0.0f);
// Linear layer: y[N,O] = x[N,I] @ w[O,I]^T + b[O] (b may be undefined).
// `compute`: Note [Reduced-precision compute].
void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                    DType compute = DType::Float32);
// dx = dy @ w (if dx defined); dw (+)= dy^T @ x; db (+)= sum_n dy (if db defined).
void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw,
                     Tensor& db, bool accumulate, DType compute = DType::Float32);

// ---- convolution (oneDNN, primitives cached per shape) ---------------------------
struct Conv2dParams {
  int stride_h = 1, stride_w = 1;
  int pad_h = 0, pad_w = 0;
  DType compute = DType::Float32;  // Note [Reduced-precision compute]
  // x, y, dx and dy are [N, H, W, C] (Note [Channels last]); w and dw stay [O, C, KH, KW].
  bool channels_last = false;
  // Grouped convolution (depthwise when groups == C): C and O divisible by it, w is
  // [O, C / groups, KH, KW], and output group g sees input group g only.
  int groups = 1;
  // Dilated (atrous) convolution: the kernel's taps `dilation` apart (1: neighbours), so a
  // window spans dilation * (K - 1) + 1 inputs (torch's dilation).
  int dilation_h = 1, dilation_w = 1;
};
// Output spatial size for input size `in`, kernel `k`, stride `s`, padding `p` and dilation
// `d` (a window spans d * (k - 1) + 1 inputs).
int64_t conv_out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d = 1);
// y[N,O,OH,OW] = conv(x[N,C,H,W], w[O,C,KH,KW]) + b[O] (b may be undefined).
void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                    const Conv2dParams& p);
void conv2d_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx, const Conv2dParams& p);
// dw (+)= ..., db (+)= sum over N,OH,OW of dy (if db defined).
void conv2d_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db,
                             const Conv2dParams& p, bool accumulate);

// ---- pooling -------------------------------------------------------------------
struct Pool2dParams {
  int kernel_h = 2, kernel_w = 2;
  int stride_h = 2, stride_w = 2;
  int pad_h = 0, pad_w = 0;
  // Max pooling only (average pooling refuses it): the output size rounds up, so a last
  // window that starts inside the input (or its left padding) and runs past its end counts,
  // clipped (PyTorch's ceil_mode=True).
  bool ceil_mode = false;
};
// Output spatial size of pooling `in` along one axis: conv_out_size, or PyTorch's ceil-mode
// size when `ceil_mode`.
int64_t pool_out_size(int64_t in, int64_t k, int64_t s, int64_t p, bool ceil_mode);
// Max pooling; `indices` (Int32, same shape as y) records the argmax within each
// input plane for the backward pass. Padding counts as -inf.
void maxpool2d_forward(const Tensor& x, Tensor& y, Tensor& indices, const Pool2dParams& p);
// An index outside its input plane is a bug (they come from maxpool2d_forward): the CPU
// raises InternalError; the GPU kernel skips it, since reporting it would cost a host
// synchronisation per call.
void maxpool2d_backward(const Tensor& dy, const Tensor& indices, Tensor& dx);
// Padding may be at most half the kernel (PyTorch's rule); more is an InternalError.
// Average pooling with PyTorch's default count_include_pad=true.
void avgpool2d_forward(const Tensor& x, Tensor& y, const Pool2dParams& p);
void avgpool2d_backward(const Tensor& dy, Tensor& dx, const Pool2dParams& p);
// Adaptive average pooling to 1x1: y[N,C,1,1] = mean over H,W.
void global_avgpool_forward(const Tensor& x, Tensor& y);
void global_avgpool_backward(const Tensor& dy, Tensor& dx);

// ---- channels last -------------------------------------------------------------
// Note [Channels last]
// ~~~~~~~~~~~~~~~~~~~~
// A model may keep its activations channels last, [N, H, W, C] in memory instead of
// [N, C, H, W] (PyTorch's channels_last memory format): the layout cuDNN's tensor-core
// convolutions read and write natively, where NCHW costs them a transpose of their
// operands. Tensors have no strides (Note [Tensor semantics]), so such an activation is a
// tensor of shape [N, H, W, C], and the ops that care are told: convolutions by
// Conv2dParams::channels_last, batch norm by taking the [N*H*W, C] view (its [N, C] case),
// global average pooling by its _channels_last variant; elementwise ops do not care.
// Weights keep PyTorch's [O, C, KH, KW] whatever the activations' layout, so files and
// optimizers never see the difference.
// y [N, H, W, C] = x [N, C, H, W] rearranged (any 4-d tensor, an [O, C, KH, KW] weight too).
void to_channels_last(const Tensor& x, Tensor& y);
// The inverse: x [N, H, W, C] -> y [N, C, H, W].
void from_channels_last(const Tensor& x, Tensor& y);
// Global average pooling over H and W of a channels-last x [N, H, W, C]: y [N, 1, 1, C],
// each average summed in row order (h, w), then scaled, as on either device.
void global_avgpool_forward_channels_last(const Tensor& x, Tensor& y);
void global_avgpool_backward_channels_last(const Tensor& dy, Tensor& dx);

// ---- batch norm (see Note [Separable batch norm]) ----------------------------------
// x may be [N,C,H,W] or [N,C] (BatchNorm1d); an undefined gamma/beta means 1/0.
// Per-channel mean and biased variance over N,H,W of x[N,C,H,W] (count = N*H*W).
// With N == 0 both are 0.
void batchnorm_stats(const Tensor& x, Tensor& mean, Tensor& var);
// y = (x - mean) * invstd * gamma + beta, per channel.
void batchnorm_apply(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                     const Tensor& gamma, const Tensor& beta, Tensor& y);
// Per channel: sum_dy = sum dy, sum_dy_xmu = sum dy * (x - mean).
void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               Tensor& sum_dy, Tensor& sum_dy_xmu);
// dx = gamma * invstd * (dy - sum_dy/count - (x - mean) * invstd^2 * sum_dy_xmu/count),
// where count is the (possibly global) number of elements per channel.
void batchnorm_backward_apply(const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& invstd, const Tensor& gamma, const Tensor& sum_dy,
                              const Tensor& sum_dy_xmu, double count, Tensor& dx);

// ---- batch norm fused with the ReLU after it (Note [Fused batch norm]) ------------
// Note [Fused batch norm]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Almost every batch norm feeds a ReLU, directly (conv, bn, relu) or through a residual
// add (relu(bn(x) + shortcut)). These ops fold that ReLU, and the add, into the batch
// norm's own elementwise passes, so the activation is read and written once instead of
// two or three times, in one kernel instead of two or three:
//   batchnorm_apply_relu           = batchnorm_apply, then add, then relu_forward;
//   batchnorm_backward_reduce_relu = relu_backward, then batchnorm_backward_reduce;
//   batchnorm_backward_apply_relu  = relu_backward, then batchnorm_backward_apply.
// The ReLU's mask is its output y (y > 0), as relu_backward reads it. Each does the
// operations of its unfused sequence in the same order, so on one device the results
// are bitwise those of the sequence.
//
// y = relu(x * scale + shift + residual), scale and shift as batchnorm_apply's; an
// undefined residual is left out (relu(bn(x))). y may not alias x or residual.
void batchnorm_apply_relu(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                          const Tensor& gamma, const Tensor& beta, const Tensor& residual,
                          Tensor& y);
// batchnorm_backward_reduce over g = (y > 0 ? dy : 0), where y is the fused output.
void batchnorm_backward_reduce_relu(const Tensor& dy, const Tensor& y, const Tensor& x,
                                    const Tensor& mean, Tensor& sum_dy, Tensor& sum_dy_xmu);
// batchnorm_backward_apply over the same g; also writes g itself to `dmasked` when it is
// defined (the residual's gradient: the add passes it on unchanged).
void batchnorm_backward_apply_relu(const Tensor& dy, const Tensor& y, const Tensor& x,
                                   const Tensor& mean, const Tensor& invstd, const Tensor& gamma,
                                   const Tensor& sum_dy, const Tensor& sum_dy_xmu, double count,
                                   Tensor& dx, Tensor& dmasked);
// batchnorm_update_running(mean, var, count, momentum, ...) then batchnorm_invstd(var,
// eps, invstd): the training forward's per-channel step between the statistics and the
// apply, one kernel on a GPU instead of two.
void batchnorm_prepare(const Tensor& mean, const Tensor& var, int64_t count, double momentum,
                       double eps, Tensor& running_mean, Tensor& running_var,
                       Tensor& num_batches_tracked, Tensor& invstd);

// ---- batch norm: the per-channel arithmetic around the kernels above ---------------
// C values each; the layers call these instead of looping on the host so that the same
// code runs on a GPU (tensor/cpu/batchnorm_channels.cpp, tensor/cuda/batchnorm_channels.cu).
// invstd = 1 / sqrt(var + eps), computed in double.
void batchnorm_invstd(const Tensor& var, double eps, Tensor& invstd);
// running_mean = (1 - momentum) * running_mean + momentum * mean;
// running_var  = (1 - momentum) * running_var + momentum * var * count / (count - 1)
// (the unbiased variance, count > 1); num_batches_tracked (Int64 scalar) += 1.
void batchnorm_update_running(const Tensor& mean, const Tensor& var, int64_t count,
                              double momentum, Tensor& running_mean, Tensor& running_var,
                              Tensor& num_batches_tracked);
// dgamma += sum_dy_xmu * invstd; dbeta += sum_dy (dL/dweight and dL/dbias; either may be
// undefined).
void batchnorm_param_grads(const Tensor& sum_dy, const Tensor& sum_dy_xmu, const Tensor& invstd,
                           Tensor& dgamma, Tensor& dbeta);
// SyncBatchNorm's merge (Note [SyncBatchNorm merge] in models/sync_batchnorm.cpp): `rows`
// is [world, 2C+1], each rank's (mean[C], biased var[C], count); writes the global mean and
// biased variance, combining ranks in rank order with Chan et al.'s pairwise update in
// double, skipping ranks whose count is 0. The caller validates the counts.
void batchnorm_merge_stats(const Tensor& rows, Tensor& mean, Tensor& var);

// ---- loss ----------------------------------------------------------------------
// Softmax cross-entropy over logits[N,K] with Int64 labels[N] in [0, K).
// Returns the *sum* of per-sample losses; writes dlogits = (softmax - onehot) * grad_scale
// when dlogits is defined (grad_scale = 1/N gives the gradient of the mean loss).
// Throws InvalidArgument for a label outside [0, K).
double cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& dlogits, float grad_scale);
// Number of rows whose argmax equals the label.
int64_t count_correct(const Tensor& logits, const Tensor& labels);
// Both of the above without waiting for them: writes stats, Int64 [kLossStats] on the
// logits' device, with {the bits of the double loss sum, the correct count, the first
// row whose label lies outside [0, K) or -1}, queued like any kernel (Note [Loss
// statistics stay on the device] in models/loss.cpp). A bad label throws nothing here:
// its row is skipped, and the sum, the count and dlogits are unspecified.
constexpr int64_t kLossStats = 3;
void loss_stats(const Tensor& logits, const Tensor& labels, Tensor& dlogits, float grad_scale, Tensor& stats);

// ---- optimizer -----------------------------------------------------------------
// One SGD step on one parameter with PyTorch's semantics (torch.optim.SGD).
// momentum_buf may be undefined when momentum == 0. Nesterov needs momentum > 0 and
// dampening == 0 (as torch.optim.SGD); optimizers must reject that with InvalidArgument
// before calling this, which treats it as an InternalError.
//   g = grad + weight_decay * param
//   if momentum != 0: buf = first_step ? g : momentum * buf + (1 - dampening) * g
//                     g = nesterov ? g + momentum * buf : buf
//   param -= lr * g
void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
              float dampening, float weight_decay, bool nesterov, bool first_step);

// The same step on every parameter of a model at once. momentum_buf entries may be
// undefined when momentum == 0; all tensors are on one device. On a GPU this is one
// multi-tensor kernel launch per group of parameters instead of one launch per
// parameter (the fused update of apex / torch.optim's foreach path); on the CPU it is
// sgd_step in a loop.
struct SgdParamRef {
  Tensor* param;
  const Tensor* grad;
  Tensor* momentum_buf;
};
void sgd_step_all(const std::vector<SgdParamRef>& params, float lr, float momentum,
                  float dampening, float weight_decay, bool nesterov, bool first_step);

// Loss scaling (Note [Dynamic loss scaling] in trainer/loop/loss_scaler.h): multiplies every
// element of every gradient by inv_scale and returns whether any element was infinite
// or NaN before (PyTorch's _amp_foreach_non_finite_check_and_unscale_). The gradients
// are then garbage and the caller skips the step. All on one device; on a GPU one flag
// is read back, so this waits for the gradients.
bool non_finite_check_and_unscale(const std::vector<Tensor*>& grads, float inv_scale);

}  // namespace mtrain::ops
