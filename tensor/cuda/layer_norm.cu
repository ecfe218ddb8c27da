// Layer normalisation on the GPU: a block per row for the statistics, y and dx; a thread
// per column for dw and db, summing its rows in order (tensor/ops.h; the CPU's
// tensor/cpu/layer_norm.cpp sums alike in double).
#include <cuda_runtime.h>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_on_shape;
using detail::first_gpu;
using detail::kThreads;

// The block's sum of `v`, on every thread.
__device__ double row_sum(double v, double* shared, double* total) {
  v = detail::block_sum(v, shared);
  if (threadIdx.x == 0) *total = v;
  __syncthreads();
  const double out = *total;
  __syncthreads();
  return out;
}

__global__ void layer_norm_forward_kernel(const float* x, const float* w, const float* b, float eps, float* y,
                                          float* mean, float* rstd, int64_t c) {
  __shared__ double shared[kThreads / 32];
  __shared__ double total;
  const int64_t r = blockIdx.x;
  const float* row = x + r * c;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < c; i += blockDim.x) sum += row[i];
  const double m = row_sum(sum, shared, &total) / static_cast<double>(c);
  double squares = 0.0;
  for (int64_t i = threadIdx.x; i < c; i += blockDim.x) squares += (row[i] - m) * (row[i] - m);
  const double s = 1.0 / sqrt(row_sum(squares, shared, &total) / static_cast<double>(c) + eps);
  if (threadIdx.x == 0) {
    mean[r] = static_cast<float>(m);
    rstd[r] = static_cast<float>(s);
  }
  for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
    y[r * c + i] = __fadd_rn(__fmul_rn(static_cast<float>((row[i] - m) * s), w[i]), b[i]);
  }
}

__global__ void layer_norm_backward_data_kernel(const float* x, const float* dy, const float* w, const float* mean,
                                                const float* rstd, float* dx, int64_t c) {
  __shared__ double shared[kThreads / 32];
  __shared__ double total;
  const int64_t r = blockIdx.x;
  const float *row = x + r * c, *grad = dy + r * c;
  const double m = mean[r], s = rstd[r];
  double g_sum = 0.0, gx_sum = 0.0;
  for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
    const double gi = static_cast<double>(grad[i]) * w[i];
    g_sum += gi;
    gx_sum += gi * ((row[i] - m) * s);
  }
  const double g_mean = row_sum(g_sum, shared, &total) / static_cast<double>(c);
  const double gx_mean = row_sum(gx_sum, shared, &total) / static_cast<double>(c);
  for (int64_t i = threadIdx.x; i < c; i += blockDim.x) {
    const double xhat = (row[i] - m) * s;
    dx[r * c + i] = static_cast<float>(s * (static_cast<double>(grad[i]) * w[i] - g_mean - xhat * gx_mean));
  }
}

__global__ void layer_norm_backward_weights_kernel(const float* x, const float* dy, const float* mean,
                                                   const float* rstd, float* dw, float* db, int64_t rows,
                                                   int64_t c) {
  for (int64_t i = detail::global_thread_index(); i < c; i += detail::grid_stride()) {
    double w_sum = 0.0, b_sum = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const double d = dy[r * c + i];
      w_sum += d * ((x[r * c + i] - static_cast<double>(mean[r])) * rstd[r]);
      b_sum += d;
    }
    dw[i] = static_cast<float>(w_sum);
    db[i] = static_cast<float>(b_sum);
  }
}

}  // namespace

void layer_norm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& y, Tensor& mean,
                        Tensor& rstd) {
  const Device device = first_gpu("layer_norm_forward", "x", x);
  const ops::LayerNormRows g = ops::layer_norm_rows("layer_norm_forward", x, w, mean, rstd);
  check_on_shape("layer_norm_forward", "b", b, device, w.shape());
  check_on_shape("layer_norm_forward", "y", y, device, x.shape());
  if (g.rows == 0) return;
  MTRAIN_CHECK(g.rows <= INT32_MAX, "layer_norm_forward: {} rows are more than one grid holds", g.rows);
  cuda::DeviceGuard guard(device.index);
  layer_norm_forward_kernel<<<static_cast<unsigned>(g.rows), kThreads, 0, detail::stream_for(device.index)>>>(
      x.data<float>(), w.data<float>(), b.data<float>(), eps, y.data<float>(), mean.data<float>(),
      rstd.data<float>(), g.features);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& w, const Tensor& mean,
                         const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  const Device device = first_gpu("layer_norm_backward", "x", x);
  const ops::LayerNormRows g = ops::layer_norm_rows("layer_norm_backward", x, w, mean, rstd);
  check_on_shape("layer_norm_backward", "dy", dy, device, x.shape());
  check_on_shape("layer_norm_backward", "dx", dx, device, x.shape());
  check_on_shape("layer_norm_backward", "dw", dw, device, w.shape());
  check_on_shape("layer_norm_backward", "db", db, device, w.shape());
  cuda::DeviceGuard guard(device.index);
  const cudaStream_t stream = detail::stream_for(device.index);
  if (g.rows > 0) {
    MTRAIN_CHECK(g.rows <= INT32_MAX, "layer_norm_backward: {} rows are more than one grid holds", g.rows);
    layer_norm_backward_data_kernel<<<static_cast<unsigned>(g.rows), kThreads, 0, stream>>>(
        x.data<float>(), dy.data<float>(), w.data<float>(), mean.data<float>(), rstd.data<float>(), dx.data<float>(),
        g.features);
    MTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  if (g.features == 0) return;
  layer_norm_backward_weights_kernel<<<detail::grid_for(g.features), kThreads, 0, stream>>>(
      x.data<float>(), dy.data<float>(), mean.data<float>(), rstd.data<float>(), dw.data<float>(), db.data<float>(),
      g.rows, g.features);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mtrain::cuda_ops
