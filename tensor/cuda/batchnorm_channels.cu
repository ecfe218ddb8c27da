// The per-channel batch-norm arithmetic on the GPU (ops::batchnorm_invstd,
// batchnorm_update_running, batchnorm_prepare, batchnorm_param_grads,
// batchnorm_merge_stats): the counterparts of tensor/cpu/batchnorm_channels.cpp.
//
// One thread per channel: C is at most a few thousand, so a launch is a handful of
// blocks and the cost is the launch itself. Every floating-point operation is spelled
// with a round-to-nearest intrinsic (__fmul_rn, __dadd_rn, ...) because nvcc would
// otherwise contract a * b + c into one fused multiply-add, whose single rounding
// differs from the CPU's two in the last bit; with the intrinsics each kernel computes,
// operation for operation, what the CPU loop computes (Note [Batch-norm channel
// arithmetic] in tensor/cpu/batchnorm_channels.cpp), so CPU and GPU runs agree bitwise
// here given the same inputs.
#include <cstdint>

#include <cuda_runtime.h>

#include "tensor/batchnorm_running_update.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t channels) {
  const int64_t blocks = (channels + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks > 0 ? blocks : 1);
}

__device__ __forceinline__ float inverse_std(float var, double eps) {
  const double denominator = __dsqrt_rn(__dadd_rn(static_cast<double>(var), eps));
  return __double2float_rn(__ddiv_rn(1.0, denominator));
}

__global__ void bn_invstd_kernel(const float* __restrict__ var, double eps,
                                 float* __restrict__ invstd, int64_t channels) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  invstd[c] = inverse_std(var[c], eps);
}

struct RunningUpdate {
  const float* __restrict__ mean;
  const float* __restrict__ var;
  float keep, take_mean, take_var;
  float* __restrict__ running_mean;
  float* __restrict__ running_var;
  int64_t* __restrict__ num_batches_tracked;
  int64_t channels;

  // Channel c's update (thread c of the grid; thread 0 also counts the batch).
  __device__ __forceinline__ void operator()(int64_t c) const {
    if (c == 0) *num_batches_tracked += 1;
    if (c >= channels) return;
    running_mean[c] = __fadd_rn(__fmul_rn(running_mean[c], keep), __fmul_rn(take_mean, mean[c]));
    running_var[c] = __fadd_rn(__fmul_rn(running_var[c], keep), __fmul_rn(take_var, var[c]));
  }
};

__global__ void bn_update_running_kernel(RunningUpdate update) {
  update(static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
}

// batchnorm_update_running and batchnorm_invstd in one launch.
__global__ void bn_prepare_kernel(RunningUpdate update, double eps, float* __restrict__ invstd) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  update(c);
  if (c < update.channels) invstd[c] = inverse_std(update.var[c], eps);
}

__global__ void bn_param_grads_kernel(const float* __restrict__ sum_dy,
                                   const float* __restrict__ sum_dy_xmu,
                                   const float* __restrict__ invstd, float* __restrict__ dgamma,
                                   float* __restrict__ dbeta, int64_t channels) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  if (dgamma != nullptr) dgamma[c] = __fadd_rn(dgamma[c], __fmul_rn(sum_dy_xmu[c], invstd[c]));
  if (dbeta != nullptr) dbeta[c] = __fadd_rn(dbeta[c], sum_dy[c]);
}

// Note [SyncBatchNorm merge] (models/sync_batchnorm.h), per channel, with the CPU loop's
// order of operations.
__global__ void bn_merge_stats_kernel(const float* __restrict__ rows, int64_t world,
                                   int64_t channels, float* __restrict__ mean,
                                   float* __restrict__ var) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int64_t row = 2 * channels + 1;
  double n = 0.0, avg = 0.0, m2 = 0.0;
  for (int64_t r = 0; r < world; ++r) {
    const float* rank_row = rows + r * row;
    const double n_j = rank_row[2 * channels];
    if (n_j <= 0.0) continue;
    const double mean_j = rank_row[c];
    const double var_j = rank_row[channels + c];
    const double n_new = __dadd_rn(n, n_j);
    const double delta = __dsub_rn(avg, mean_j);
    // m2 += var_j * n_j + delta * delta * n * n_j / n_new
    const double spread = __ddiv_rn(__dmul_rn(__dmul_rn(__dmul_rn(delta, delta), n), n_j), n_new);
    m2 = __dadd_rn(m2, __dadd_rn(__dmul_rn(var_j, n_j), spread));
    // avg = (n * avg + n_j * mean_j) / n_new
    avg = __ddiv_rn(__dadd_rn(__dmul_rn(n, avg), __dmul_rn(n_j, mean_j)), n_new);
    n = n_new;
  }
  mean[c] = __double2float_rn(avg);
  var[c] = n > 0.0 ? __double2float_rn(__ddiv_rn(m2, n)) : 0.0f;
}

// Queued on `stream`; raw device pointers.
void launch_batchnorm_invstd(const float* var, double eps, float* invstd, int64_t channels,
                             cudaStream_t stream) {
  if (channels == 0) return;
  bn_invstd_kernel<<<blocks_for(channels), kThreads, 0, stream>>>(var, eps, invstd, channels);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void launch_batchnorm_update_running(const RunningUpdate& update, cudaStream_t stream) {
  // Launched even for 0 channels: the batch still counts in num_batches_tracked.
  bn_update_running_kernel<<<blocks_for(update.channels), kThreads, 0, stream>>>(update);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void launch_batchnorm_prepare(const RunningUpdate& update, double eps, float* invstd,
                              cudaStream_t stream) {
  bn_prepare_kernel<<<blocks_for(update.channels), kThreads, 0, stream>>>(update, eps, invstd);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void launch_batchnorm_param_grads(const float* sum_dy, const float* sum_dy_xmu,
                                  const float* invstd, float* dgamma, float* dbeta,
                                  int64_t channels, cudaStream_t stream) {
  if (channels == 0 || (dgamma == nullptr && dbeta == nullptr)) return;
  bn_param_grads_kernel<<<blocks_for(channels), kThreads, 0, stream>>>(sum_dy, sum_dy_xmu, invstd,
                                                                    dgamma, dbeta, channels);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void launch_batchnorm_merge_stats(const float* rows, int64_t world, int64_t channels,
                                  float* mean, float* var, cudaStream_t stream) {
  if (channels == 0) return;
  bn_merge_stats_kernel<<<blocks_for(channels), kThreads, 0, stream>>>(rows, world, channels, mean,
                                                                    var);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace
}  // namespace mtrain::cuda

namespace mtrain::cuda_ops {
namespace {

using detail::check_ndim;
using detail::check_on;
using detail::check_on_shape;
using mtrain::detail::RunningUpdateFactors;
using mtrain::detail::running_update_factors;

// The channel count of a [C] float32 tensor on a GPU.
int64_t channels_on(const char* op, const char* name, const Tensor& t) {
  check_on(op, name, t, t.device());
  check_ndim(op, name, t, 1);
  return t.numel();
}

cudaStream_t stream_of(Device device) { return cuda::current_stream(device.index).handle(); }

// Checks the running update's tensors and gathers its arguments.
cuda::RunningUpdate running_update(const char* op, const Tensor& mean, const Tensor& var,
                                   int64_t count, double momentum, Tensor& running_mean,
                                   Tensor& running_var, Tensor& num_batches_tracked) {
  const Device device = mean.device();
  const int64_t c = channels_on(op, "mean", mean);
  check_on_shape(op, "var", var, device, {c});
  check_on_shape(op, "running_mean", running_mean, device, {c});
  check_on_shape(op, "running_var", running_var, device, {c});
  check_on_shape(op, "num_batches_tracked", num_batches_tracked, device, {}, DType::Int64);
  const RunningUpdateFactors f = running_update_factors(op, count, momentum);
  return {mean.data<float>(),
          var.data<float>(),
          f.keep,
          f.take_mean,
          f.take_var,
          running_mean.data<float>(),
          running_var.data<float>(),
          num_batches_tracked.data<int64_t>(),
          c};
}

}  // namespace

void batchnorm_invstd(const Tensor& var, double eps, Tensor& invstd) {
  const char* op = "batchnorm_invstd";
  const Device device = var.device();
  const int64_t c = channels_on(op, "var", var);
  check_on_shape(op, "invstd", invstd, device, {c});
  cuda::DeviceGuard guard(device.index);
  cuda::launch_batchnorm_invstd(var.data<float>(), eps, invstd.data<float>(), c,
                                stream_of(device));
}

void batchnorm_update_running(const Tensor& mean, const Tensor& var, int64_t count,
                              double momentum, Tensor& running_mean, Tensor& running_var,
                              Tensor& num_batches_tracked) {
  const cuda::RunningUpdate update = running_update("batchnorm_update_running", mean, var, count,
                                                    momentum, running_mean, running_var,
                                                    num_batches_tracked);
  cuda::DeviceGuard guard(mean.device().index);
  cuda::launch_batchnorm_update_running(update, stream_of(mean.device()));
}

void batchnorm_prepare(const Tensor& mean, const Tensor& var, int64_t count, double momentum,
                       double eps, Tensor& running_mean, Tensor& running_var,
                       Tensor& num_batches_tracked, Tensor& invstd) {
  const char* op = "batchnorm_prepare";
  const cuda::RunningUpdate update =
      running_update(op, mean, var, count, momentum, running_mean, running_var, num_batches_tracked);
  check_on_shape(op, "invstd", invstd, mean.device(), {update.channels});
  cuda::DeviceGuard guard(mean.device().index);
  cuda::launch_batchnorm_prepare(update, eps, invstd.data<float>(), stream_of(mean.device()));
}

void batchnorm_param_grads(const Tensor& sum_dy, const Tensor& sum_dy_xmu, const Tensor& invstd,
                           Tensor& dgamma, Tensor& dbeta) {
  const char* op = "batchnorm_param_grads";
  const Device device = sum_dy.device();
  const int64_t c = channels_on(op, "sum_dy", sum_dy);
  check_on_shape(op, "sum_dy_xmu", sum_dy_xmu, device, {c});
  check_on_shape(op, "invstd", invstd, device, {c});
  if (dgamma.defined()) check_on_shape(op, "dgamma", dgamma, device, {c});
  if (dbeta.defined()) check_on_shape(op, "dbeta", dbeta, device, {c});
  cuda::DeviceGuard guard(device.index);
  cuda::launch_batchnorm_param_grads(sum_dy.data<float>(), sum_dy_xmu.data<float>(),
                                     invstd.data<float>(),
                                     dgamma.defined() ? dgamma.data<float>() : nullptr,
                                     dbeta.defined() ? dbeta.data<float>() : nullptr, c,
                                     stream_of(device));
}

void batchnorm_merge_stats(const Tensor& rows, Tensor& mean, Tensor& var) {
  const char* op = "batchnorm_merge_stats";
  const Device device = rows.device();
  check_on(op, "rows", rows, device);
  check_ndim(op, "rows", rows, 2);
  const int64_t row = rows.size(1);
  MTRAIN_CHECK(row >= 3 && row % 2 == 1, "{}: rows must be [world, 2C+1] with C >= 1, found {}",
               op, shape_str(rows.shape()));
  const int64_t c = (row - 1) / 2;
  check_on_shape(op, "mean", mean, device, {c});
  check_on_shape(op, "var", var, device, {c});
  cuda::DeviceGuard guard(device.index);
  cuda::launch_batchnorm_merge_stats(rows.data<float>(), rows.size(0), c, mean.data<float>(),
                                     var.data<float>(), stream_of(device));
}

}  // namespace mtrain::cuda_ops
