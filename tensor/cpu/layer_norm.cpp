// Layer normalisation on the host: rows in parallel for the statistics, y and dx; columns
// in parallel for dw and db, each summing its rows in order (ops.h).
#include <cmath>

#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {

void cpu::layer_norm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& y, Tensor& mean,
                             Tensor& rstd) {
  const LayerNormRows g = layer_norm_rows("layer_norm_forward", x, w, mean, rstd);
  check_float_shape("layer_norm_forward", "b", b, w.shape());
  check_float_shape("layer_norm_forward", "y", y, x.shape());
  cpu::use_configured_threads();
  const float *px = x.data<float>(), *pw = w.data<float>(), *pb = b.data<float>();
  float *py = y.data<float>(), *pm = mean.data<float>(), *pr = rstd.data<float>();
  const int64_t c = g.features;
#pragma omp parallel for if (g.rows * c >= cpu::kParallelGrain)
  for (int64_t r = 0; r < g.rows; ++r) {
    const float* row = px + r * c;
    double sum = 0.0;
    for (int64_t i = 0; i < c; ++i) sum += row[i];
    const double m = sum / static_cast<double>(c);
    double squares = 0.0;
    for (int64_t i = 0; i < c; ++i) squares += (row[i] - m) * (row[i] - m);
    const double s = 1.0 / std::sqrt(squares / static_cast<double>(c) + eps);
    pm[r] = static_cast<float>(m);
    pr[r] = static_cast<float>(s);
    for (int64_t i = 0; i < c; ++i) py[r * c + i] = static_cast<float>((row[i] - m) * s) * pw[i] + pb[i];
  }
}

void cpu::layer_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& w, const Tensor& mean,
                              const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  const LayerNormRows g = layer_norm_rows("layer_norm_backward", x, w, mean, rstd);
  check_float_shape("layer_norm_backward", "dy", dy, x.shape());
  check_float_shape("layer_norm_backward", "dx", dx, x.shape());
  check_float_shape("layer_norm_backward", "dw", dw, w.shape());
  check_float_shape("layer_norm_backward", "db", db, w.shape());
  cpu::use_configured_threads();
  const float *px = x.data<float>(), *pdy = dy.data<float>(), *pw = w.data<float>();
  const float *pm = mean.data<float>(), *pr = rstd.data<float>();
  float *pdx = dx.data<float>(), *pdw = dw.data<float>(), *pdb = db.data<float>();
  const int64_t c = g.features;
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w.
#pragma omp parallel for if (g.rows * c >= cpu::kParallelGrain)
  for (int64_t r = 0; r < g.rows; ++r) {
    const float *row = px + r * c, *grad = pdy + r * c;
    double g_sum = 0.0, gx_sum = 0.0;
    for (int64_t i = 0; i < c; ++i) {
      const double xhat = (row[i] - static_cast<double>(pm[r])) * pr[r];
      const double gi = static_cast<double>(grad[i]) * pw[i];
      g_sum += gi;
      gx_sum += gi * xhat;
    }
    const double g_mean = g_sum / static_cast<double>(c), gx_mean = gx_sum / static_cast<double>(c);
    for (int64_t i = 0; i < c; ++i) {
      const double xhat = (row[i] - static_cast<double>(pm[r])) * pr[r];
      pdx[r * c + i] = static_cast<float>(pr[r] * (static_cast<double>(grad[i]) * pw[i] - g_mean - xhat * gx_mean));
    }
  }
#pragma omp parallel for if (g.rows * c >= cpu::kParallelGrain)
  for (int64_t i = 0; i < c; ++i) {
    double w_sum = 0.0, b_sum = 0.0;
    for (int64_t r = 0; r < g.rows; ++r) {
      const double d = pdy[r * c + i];
      w_sum += d * ((px[r * c + i] - static_cast<double>(pm[r])) * pr[r]);
      b_sum += d;
    }
    pdw[i] = static_cast<float>(w_sum);
    pdb[i] = static_cast<float>(b_sum);
  }
}

}  // namespace mtrain::ops
