// The per-channel arithmetic of the batch-norm layers (C values per call): the inverse
// standard deviation, the running-statistics update (and both at once,
// batchnorm_prepare), the weight and bias gradients and SyncBatchNorm's merge of every
// rank's statistics, on the CPU.
//
// Note [Batch-norm channel arithmetic]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The multi-process SyncBatchNorm tests compare against single-process BatchNorm2d
// bitwise, so the arithmetic is fixed operation for operation: the running update is
// `r = r * (1 - m)` then `r += m' * x` in float32 with the factors rounded to float
// first (tensor/batchnorm_running_update.h), the gradients `g += a * b` in float32, the
// inverse standard deviation and the merge in double. The GPU kernels
// (tensor/cuda/batchnorm_channels.cu) spell the same operations with round-to-nearest
// intrinsics, so that nvcc's contraction into fused multiply-adds cannot make them
// differ from these in the last bit. (g++ contracts only where the target has FMA; the
// build targets baseline x86-64, which has none, so these loops round every operation.)
#include <cmath>

#include "tensor/batchnorm_running_update.h"
#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

using detail::RunningUpdateFactors;
using detail::running_update_factors;

// The channel count of a [C] float32 tensor.
int64_t channels_of(const char* op, const char* name, const Tensor& t) {
  cpu::check_float(op, name, t);
  cpu::check_ndim(op, name, t, 1);
  return t.numel();
}

}  // namespace

void cpu::batchnorm_invstd(const Tensor& var, double eps, Tensor& invstd) {
  const int64_t c = channels_of("batchnorm_invstd", "var", var);
  cpu::check_float_shape("batchnorm_invstd", "invstd", invstd, {c});
  const float* v = var.data<float>();
  float* out = invstd.data<float>();
  for (int64_t i = 0; i < c; ++i) {
    out[i] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(v[i]) + eps));
  }
}

void cpu::batchnorm_update_running(const Tensor& mean, const Tensor& var, int64_t count,
                                   double momentum, Tensor& running_mean, Tensor& running_var,
                                   Tensor& num_batches_tracked) {
  const char* op = "batchnorm_update_running";
  const int64_t c = channels_of(op, "mean", mean);
  cpu::check_float_shape(op, "var", var, {c});
  cpu::check_float_shape(op, "running_mean", running_mean, {c});
  cpu::check_float_shape(op, "running_var", running_var, {c});
  cpu::check_dtype(op, "num_batches_tracked", num_batches_tracked, DType::Int64);
  cpu::check_shape(op, "num_batches_tracked", num_batches_tracked, {});
  const RunningUpdateFactors f = running_update_factors(op, count, momentum);
  const float* pm = mean.data<float>();
  const float* pv = var.data<float>();
  float* rm = running_mean.data<float>();
  float* rv = running_var.data<float>();
  for (int64_t i = 0; i < c; ++i) {
    rm[i] *= f.keep;
    rm[i] += f.take_mean * pm[i];
    rv[i] *= f.keep;
    rv[i] += f.take_var * pv[i];
  }
  num_batches_tracked.data<int64_t>()[0] += 1;
}

void cpu::batchnorm_prepare(const Tensor& mean, const Tensor& var, int64_t count, double momentum,
                            double eps, Tensor& running_mean, Tensor& running_var,
                            Tensor& num_batches_tracked, Tensor& invstd) {
  cpu::batchnorm_update_running(mean, var, count, momentum, running_mean, running_var,
                                num_batches_tracked);
  cpu::batchnorm_invstd(var, eps, invstd);
}

void cpu::batchnorm_param_grads(const Tensor& sum_dy, const Tensor& sum_dy_xmu,
                                const Tensor& invstd, Tensor& dgamma, Tensor& dbeta) {
  const char* op = "batchnorm_param_grads";
  const int64_t c = channels_of(op, "sum_dy", sum_dy);
  cpu::check_float_shape(op, "sum_dy_xmu", sum_dy_xmu, {c});
  cpu::check_float_shape(op, "invstd", invstd, {c});
  if (dgamma.defined()) {
    cpu::check_float_shape(op, "dgamma", dgamma, {c});
    const float* sdyxmu = sum_dy_xmu.data<float>();
    const float* pi = invstd.data<float>();
    float* dg = dgamma.data<float>();
    for (int64_t i = 0; i < c; ++i) dg[i] += sdyxmu[i] * pi[i];
  }
  if (dbeta.defined()) {
    cpu::check_float_shape(op, "dbeta", dbeta, {c});
    const float* sdy = sum_dy.data<float>();
    float* db = dbeta.data<float>();
    for (int64_t i = 0; i < c; ++i) db[i] += sdy[i];
  }
}

void cpu::batchnorm_merge_stats(const Tensor& rows, Tensor& mean, Tensor& var) {
  const char* op = "batchnorm_merge_stats";
  cpu::check_float(op, "rows", rows);
  cpu::check_ndim(op, "rows", rows, 2);
  const int64_t world = rows.size(0);
  const int64_t row = rows.size(1);
  MTRAIN_CHECK(row >= 3 && row % 2 == 1, "{}: rows must be [world, 2C+1] with C >= 1, found {}",
               op, shape_str(rows.shape()));
  const int64_t c = (row - 1) / 2;
  cpu::check_float_shape(op, "mean", mean, {c});
  cpu::check_float_shape(op, "var", var, {c});
  const float* pr = rows.data<float>();
  float* merged_mean = mean.data<float>();
  float* merged_var = var.data<float>();
  // Note [SyncBatchNorm merge] in models/sync_batchnorm.h.
  for (int64_t i = 0; i < c; ++i) {
    double n = 0.0, avg = 0.0, m2 = 0.0;
    for (int64_t r = 0; r < world; ++r) {
      const float* rank_row = pr + r * row;
      const double n_j = rank_row[2 * c];
      if (n_j <= 0.0) continue;
      const double mean_j = rank_row[i];
      const double var_j = rank_row[c + i];
      const double n_new = n + n_j;
      const double delta = avg - mean_j;
      m2 += var_j * n_j + delta * delta * n * n_j / n_new;
      avg = (n * avg + n_j * mean_j) / n_new;
      n = n_new;
    }
    // No contributing rank: zeros, as batchnorm_stats gives for an empty batch.
    merged_mean[i] = static_cast<float>(avg);
    merged_var[i] = n > 0.0 ? static_cast<float>(m2 / n) : 0.0f;
  }
}

}  // namespace mtrain::ops
