// Batch-norm kernels (see Note [Separable batch norm] in tensor/ops.h).
//
// Note [Batch-norm reductions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Per-channel sums run over N*H*W elements (200k for a 256x28x28 batch), too many
// for a float accumulator. Each (n, c) plane is summed in double by one thread
// (contiguous, vectorised), the per-plane partials land in a scratch array, and the
// partials are added per channel in a fixed order. Parallelising over planes rather
// than channels keeps every thread busy even for C = 1, and the fixed order makes
// the result independent of the thread count. Variance is two-pass (sum of squared
// deviations from the mean, kept in double), which does not cancel catastrophically the
// way E[x^2] - E[x]^2 does.
#include <vector>

#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

struct BnGeometry {
  int64_t n, c, area;
};

BnGeometry bn_geometry(const char* op, const char* name, const Tensor& x) {
  cpu::check_float(op, name, x);
  MTRAIN_CHECK(x.ndim() == 4 || x.ndim() == 2, "{}: {} must be [N,C,H,W] or [N,C], found {}", op,
               name, shape_str(x.shape()));
  const int64_t area = x.ndim() == 4 ? x.size(2) * x.size(3) : 1;
  return {x.size(0), x.size(1), area};
}

// Grows only, so the steady state does not allocate.
std::vector<double>& plane_scratch(size_t size) {
  thread_local std::vector<double> scratch;
  if (scratch.size() < size) scratch.resize(size);
  return scratch;
}

// Optional per-channel parameter (undefined = the identity value).
const float* optional_param(const char* op, const char* name, const Tensor& t, int64_t c) {
  if (!t.defined()) return nullptr;
  cpu::check_float_shape(op, name, t, {c});
  return t.data<float>();
}

bool parallel_over_planes(const BnGeometry& g) { return g.n * g.c * g.area >= cpu::kParallelGrain; }

}  // namespace

void cpu::batchnorm_stats(const Tensor& x, Tensor& mean, Tensor& var) {
  const BnGeometry g = bn_geometry("batchnorm_stats", "x", x);
  cpu::check_float_shape("batchnorm_stats", "mean", mean, {g.c});
  cpu::check_float_shape("batchnorm_stats", "var", var, {g.c});
  cpu::use_configured_threads();
  const int64_t planes = g.n * g.c;
  const int64_t count = g.n * g.area;
  float* pm = mean.data<float>();
  float* pv = var.data<float>();
  if (count == 0) {
    for (int64_t c = 0; c < g.c; ++c) pm[c] = pv[c] = 0.0f;
    return;
  }
  const float* px = x.data<float>();
  std::vector<double>& partial = plane_scratch(static_cast<size_t>(planes));
  double* pp = partial.data();
  const bool parallel = parallel_over_planes(g);

#pragma omp parallel for if (parallel)
  for (int64_t plane = 0; plane < planes; ++plane) {
    const float* xp = px + plane * g.area;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < g.area; ++i) s += xp[i];
    pp[plane] = s;
  }
  // The deviations are taken from the double mean: around its float rounding the
  // variance would gain (rounding error)^2, which is not small next to a tiny variance
  // of large values (1e6 and its float neighbours: +50 %).
  std::vector<double> means(static_cast<size_t>(g.c));
  for (int64_t c = 0; c < g.c; ++c) {
    double s = 0.0;
    for (int64_t n = 0; n < g.n; ++n) s += pp[n * g.c + c];
    means[static_cast<size_t>(c)] = s / static_cast<double>(count);
    pm[c] = static_cast<float>(means[static_cast<size_t>(c)]);
  }
  const double* pmd = means.data();

#pragma omp parallel for if (parallel)
  for (int64_t plane = 0; plane < planes; ++plane) {
    const float* xp = px + plane * g.area;
    const double m = pmd[plane % g.c];
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < g.area; ++i) {
      const double d = xp[i] - m;
      s += d * d;
    }
    pp[plane] = s;
  }
  for (int64_t c = 0; c < g.c; ++c) {
    double s = 0.0;
    for (int64_t n = 0; n < g.n; ++n) s += pp[n * g.c + c];
    pv[c] = static_cast<float>(s / static_cast<double>(count));
  }
}

void cpu::batchnorm_apply(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                          const Tensor& gamma, const Tensor& beta, Tensor& y) {
  const BnGeometry g = bn_geometry("batchnorm_apply", "x", x);
  cpu::check_float_shape("batchnorm_apply", "mean", mean, {g.c});
  cpu::check_float_shape("batchnorm_apply", "invstd", invstd, {g.c});
  cpu::check_float_shape("batchnorm_apply", "y", y, x.shape());
  const float* pg = optional_param("batchnorm_apply", "gamma", gamma, g.c);
  const float* pb = optional_param("batchnorm_apply", "beta", beta, g.c);
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  const float* pm = mean.data<float>();
  const float* pi = invstd.data<float>();
  float* py = y.data<float>();
  const int64_t planes = g.n * g.c;
#pragma omp parallel for if (parallel_over_planes(g))
  for (int64_t plane = 0; plane < planes; ++plane) {
    const int64_t c = plane % g.c;
    // y = x * scale + shift with the per-channel constants folded once.
    const float scale = pi[c] * (pg ? pg[c] : 1.0f);
    const float shift = (pb ? pb[c] : 0.0f) - pm[c] * scale;
    const float* xp = px + plane * g.area;
    float* yp = py + plane * g.area;
#pragma omp simd
    for (int64_t i = 0; i < g.area; ++i) yp[i] = xp[i] * scale + shift;
  }
}

void cpu::batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                    Tensor& sum_dy, Tensor& sum_dy_xmu) {
  const BnGeometry g = bn_geometry("batchnorm_backward_reduce", "x", x);
  cpu::check_float_shape("batchnorm_backward_reduce", "dy", dy, x.shape());
  cpu::check_float_shape("batchnorm_backward_reduce", "mean", mean, {g.c});
  cpu::check_float_shape("batchnorm_backward_reduce", "sum_dy", sum_dy, {g.c});
  cpu::check_float_shape("batchnorm_backward_reduce", "sum_dy_xmu", sum_dy_xmu, {g.c});
  cpu::use_configured_threads();
  const int64_t planes = g.n * g.c;
  const float* pdy = dy.data<float>();
  const float* px = x.data<float>();
  const float* pm = mean.data<float>();
  std::vector<double>& partial = plane_scratch(static_cast<size_t>(2 * planes));
  double* p_dy = partial.data();
  double* p_dy_xmu = partial.data() + planes;
#pragma omp parallel for if (parallel_over_planes(g))
  for (int64_t plane = 0; plane < planes; ++plane) {
    const double m = pm[plane % g.c];
    const float* xp = px + plane * g.area;
    const float* dyp = pdy + plane * g.area;
    double s = 0.0, sx = 0.0;
#pragma omp simd reduction(+ : s, sx)
    for (int64_t i = 0; i < g.area; ++i) {
      s += dyp[i];
      sx += static_cast<double>(dyp[i]) * (xp[i] - m);
    }
    p_dy[plane] = s;
    p_dy_xmu[plane] = sx;
  }
  float* out_dy = sum_dy.data<float>();
  float* out_dy_xmu = sum_dy_xmu.data<float>();
  for (int64_t c = 0; c < g.c; ++c) {
    double s = 0.0, sx = 0.0;
    for (int64_t n = 0; n < g.n; ++n) {
      s += p_dy[n * g.c + c];
      sx += p_dy_xmu[n * g.c + c];
    }
    out_dy[c] = static_cast<float>(s);
    out_dy_xmu[c] = static_cast<float>(sx);
  }
}

void cpu::batchnorm_backward_apply(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                   const Tensor& invstd, const Tensor& gamma, const Tensor& sum_dy,
                                   const Tensor& sum_dy_xmu, double count, Tensor& dx) {
  const BnGeometry g = bn_geometry("batchnorm_backward_apply", "x", x);
  cpu::check_float_shape("batchnorm_backward_apply", "dy", dy, x.shape());
  cpu::check_float_shape("batchnorm_backward_apply", "mean", mean, {g.c});
  cpu::check_float_shape("batchnorm_backward_apply", "invstd", invstd, {g.c});
  cpu::check_float_shape("batchnorm_backward_apply", "sum_dy", sum_dy, {g.c});
  cpu::check_float_shape("batchnorm_backward_apply", "sum_dy_xmu", sum_dy_xmu, {g.c});
  cpu::check_float_shape("batchnorm_backward_apply", "dx", dx, x.shape());
  MTRAIN_CHECK(count >= 0.0, "batchnorm_backward_apply: count must be >= 0, got {}", count);
  const float* pg = optional_param("batchnorm_backward_apply", "gamma", gamma, g.c);
  cpu::use_configured_threads();
  const float* pdy = dy.data<float>();
  const float* px = x.data<float>();
  const float* pm = mean.data<float>();
  const float* pi = invstd.data<float>();
  const float* psd = sum_dy.data<float>();
  const float* psdx = sum_dy_xmu.data<float>();
  float* pdx = dx.data<float>();
  // With no elements anywhere the reductions are empty: their means are 0, not 0/0.
  const double inv_count = count > 0.0 ? 1.0 / count : 0.0;
  const int64_t planes = g.n * g.c;
#pragma omp parallel for if (parallel_over_planes(g))
  for (int64_t plane = 0; plane < planes; ++plane) {
    const int64_t c = plane % g.c;
    const float scale = (pg ? pg[c] : 1.0f) * pi[c];
    const float mean_dy = static_cast<float>(psd[c] * inv_count);
    const float proj = static_cast<float>(static_cast<double>(pi[c]) * pi[c] * psdx[c] * inv_count);
    const float m = pm[c];
    const float* xp = px + plane * g.area;
    const float* dyp = pdy + plane * g.area;
    float* dxp = pdx + plane * g.area;
#pragma omp simd
    for (int64_t i = 0; i < g.area; ++i) dxp[i] = scale * (dyp[i] - mean_dy - (xp[i] - m) * proj);
  }
}

}  // namespace mtrain::ops
