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

namespace {

// The elementwise and reduction passes below serve the plain ops and their fused
// variants (Note [Fused batch norm] in ops.h) alike: one template per pass, its options
// compile-time, so each instantiation is the loop of its op and the fused one does the
// unfused sequence's operations in its order.

// y = x * scale + shift, plus residual when kResidual, through a ReLU when kRelu.
struct ApplyArgs {
  const float *x, *mean, *invstd, *gamma, *beta, *residual;
  float* y;
};

template <bool kResidual, bool kRelu>
void apply_planes(const BnGeometry& g, const ApplyArgs& a) {
  const int64_t planes = g.n * g.c;
#pragma omp parallel for if (parallel_over_planes(g))
  for (int64_t plane = 0; plane < planes; ++plane) {
    const int64_t c = plane % g.c;
    // y = x * scale + shift with the per-channel constants folded once.
    const float scale = a.invstd[c] * (a.gamma ? a.gamma[c] : 1.0f);
    const float shift = (a.beta ? a.beta[c] : 0.0f) - a.mean[c] * scale;
    const float* xp = a.x + plane * g.area;
    const float* rp = kResidual ? a.residual + plane * g.area : nullptr;
    float* yp = a.y + plane * g.area;
#pragma omp simd
    for (int64_t i = 0; i < g.area; ++i) {
      float v = xp[i] * scale + shift;
      if constexpr (kResidual) v = v + rp[i];
      if constexpr (kRelu) v = v > 0.0f ? v : 0.0f;
      yp[i] = v;
    }
  }
}

// The gradient reaching the batch norm's output: dy, or dy through the ReLU whose output
// is y (relu_backward's formula; both loads unconditional so the select vectorises).
template <bool kMask>
inline float output_grad(const float* dyp, const float* yp, int64_t i) {
  const float g = dyp[i];
  if constexpr (kMask) return yp[i] > 0.0f ? g : 0.0f;
  return g;
}

// Per channel: sum_dy = sum g, sum_dy_xmu = sum g * (x - mean), g = output_grad<kMask>.
template <bool kMask>
void reduce_planes(const BnGeometry& g, const float* pdy, const float* py, const float* px,
                   const float* pm, float* out_dy, float* out_dy_xmu) {
  const int64_t planes = g.n * g.c;
  std::vector<double>& partial = plane_scratch(static_cast<size_t>(2 * planes));
  double* p_dy = partial.data();
  double* p_dy_xmu = partial.data() + planes;
#pragma omp parallel for if (parallel_over_planes(g))
  for (int64_t plane = 0; plane < planes; ++plane) {
    const double m = pm[plane % g.c];
    const float* xp = px + plane * g.area;
    const float* dyp = pdy + plane * g.area;
    const float* yp = kMask ? py + plane * g.area : nullptr;
    double s = 0.0, sx = 0.0;
#pragma omp simd reduction(+ : s, sx)
    for (int64_t i = 0; i < g.area; ++i) {
      const float gi = output_grad<kMask>(dyp, yp, i);
      s += gi;
      sx += static_cast<double>(gi) * (xp[i] - m);
    }
    p_dy[plane] = s;
    p_dy_xmu[plane] = sx;
  }
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

struct BackwardApplyArgs {
  const float *dy, *y, *x, *mean, *invstd, *gamma, *sum_dy, *sum_dy_xmu;
  double count;
  float *dx, *dmasked;
};

// dx = scale * (g - mean_dy - (x - mean) * proj) with g = output_grad<kMask>; g itself
// to dmasked when kWriteMasked.
template <bool kMask, bool kWriteMasked>
void backward_apply_planes(const BnGeometry& g, const BackwardApplyArgs& a) {
  // With no elements anywhere the reductions are empty: their means are 0, not 0/0.
  const double inv_count = a.count > 0.0 ? 1.0 / a.count : 0.0;
  const int64_t planes = g.n * g.c;
#pragma omp parallel for if (parallel_over_planes(g))
  for (int64_t plane = 0; plane < planes; ++plane) {
    const int64_t c = plane % g.c;
    const float scale = (a.gamma ? a.gamma[c] : 1.0f) * a.invstd[c];
    const float mean_dy = static_cast<float>(a.sum_dy[c] * inv_count);
    const float proj =
        static_cast<float>(static_cast<double>(a.invstd[c]) * a.invstd[c] * a.sum_dy_xmu[c] * inv_count);
    const float m = a.mean[c];
    const float* xp = a.x + plane * g.area;
    const float* dyp = a.dy + plane * g.area;
    const float* yp = kMask ? a.y + plane * g.area : nullptr;
    float* dxp = a.dx + plane * g.area;
    float* gp = kWriteMasked ? a.dmasked + plane * g.area : nullptr;
#pragma omp simd
    for (int64_t i = 0; i < g.area; ++i) {
      const float gi = output_grad<kMask>(dyp, yp, i);
      dxp[i] = scale * (gi - mean_dy - (xp[i] - m) * proj);
      if constexpr (kWriteMasked) gp[i] = gi;
    }
  }
}

// The checks every apply shares; returns x's geometry.
BnGeometry check_apply(const char* op, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                       const Tensor& y) {
  const BnGeometry g = bn_geometry(op, "x", x);
  cpu::check_float_shape(op, "mean", mean, {g.c});
  cpu::check_float_shape(op, "invstd", invstd, {g.c});
  cpu::check_float_shape(op, "y", y, x.shape());
  return g;
}

BnGeometry check_reduce(const char* op, const Tensor& dy, const Tensor& x, const Tensor& mean,
                        const Tensor& sum_dy, const Tensor& sum_dy_xmu) {
  const BnGeometry g = bn_geometry(op, "x", x);
  cpu::check_float_shape(op, "dy", dy, x.shape());
  cpu::check_float_shape(op, "mean", mean, {g.c});
  cpu::check_float_shape(op, "sum_dy", sum_dy, {g.c});
  cpu::check_float_shape(op, "sum_dy_xmu", sum_dy_xmu, {g.c});
  return g;
}

// Checks the backward apply's arguments (but the mask's) and gathers them.
BackwardApplyArgs backward_apply_args(const char* op, const BnGeometry& g, const Tensor& dy,
                                      const Tensor& x, const Tensor& mean, const Tensor& invstd,
                                      const Tensor& gamma, const Tensor& sum_dy,
                                      const Tensor& sum_dy_xmu, double count, Tensor& dx) {
  cpu::check_float_shape(op, "dy", dy, x.shape());
  cpu::check_float_shape(op, "mean", mean, {g.c});
  cpu::check_float_shape(op, "invstd", invstd, {g.c});
  cpu::check_float_shape(op, "sum_dy", sum_dy, {g.c});
  cpu::check_float_shape(op, "sum_dy_xmu", sum_dy_xmu, {g.c});
  cpu::check_float_shape(op, "dx", dx, x.shape());
  MTRAIN_CHECK(count >= 0.0, "{}: count must be >= 0, got {}", op, count);
  return {dy.data<float>(),     nullptr,
          x.data<float>(),      mean.data<float>(),
          invstd.data<float>(), optional_param(op, "gamma", gamma, g.c),
          sum_dy.data<float>(), sum_dy_xmu.data<float>(),
          count,                dx.data<float>(),
          nullptr};
}

}  // namespace

void cpu::batchnorm_apply(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                          const Tensor& gamma, const Tensor& beta, Tensor& y) {
  const char* op = "batchnorm_apply";
  const BnGeometry g = check_apply(op, x, mean, invstd, y);
  const ApplyArgs a{x.data<float>(), mean.data<float>(), invstd.data<float>(),
                    optional_param(op, "gamma", gamma, g.c), optional_param(op, "beta", beta, g.c),
                    nullptr, y.data<float>()};
  cpu::use_configured_threads();
  apply_planes<false, false>(g, a);
}

void cpu::batchnorm_apply_relu(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                               const Tensor& gamma, const Tensor& beta, const Tensor& residual,
                               Tensor& y) {
  const char* op = "batchnorm_apply_relu";
  const BnGeometry g = check_apply(op, x, mean, invstd, y);
  if (residual.defined()) cpu::check_float_shape(op, "residual", residual, x.shape());
  const ApplyArgs a{x.data<float>(),
                    mean.data<float>(),
                    invstd.data<float>(),
                    optional_param(op, "gamma", gamma, g.c),
                    optional_param(op, "beta", beta, g.c),
                    residual.defined() ? residual.data<float>() : nullptr,
                    y.data<float>()};
  cpu::use_configured_threads();
  if (residual.defined()) {
    apply_planes<true, true>(g, a);
  } else {
    apply_planes<false, true>(g, a);
  }
}

void cpu::batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                    Tensor& sum_dy, Tensor& sum_dy_xmu) {
  const BnGeometry g = check_reduce("batchnorm_backward_reduce", dy, x, mean, sum_dy, sum_dy_xmu);
  cpu::use_configured_threads();
  reduce_planes<false>(g, dy.data<float>(), nullptr, x.data<float>(), mean.data<float>(),
                       sum_dy.data<float>(), sum_dy_xmu.data<float>());
}

void cpu::batchnorm_backward_reduce_relu(const Tensor& dy, const Tensor& y, const Tensor& x,
                                         const Tensor& mean, Tensor& sum_dy, Tensor& sum_dy_xmu) {
  const char* op = "batchnorm_backward_reduce_relu";
  const BnGeometry g = check_reduce(op, dy, x, mean, sum_dy, sum_dy_xmu);
  cpu::check_float_shape(op, "y", y, x.shape());
  cpu::use_configured_threads();
  reduce_planes<true>(g, dy.data<float>(), y.data<float>(), x.data<float>(), mean.data<float>(),
                      sum_dy.data<float>(), sum_dy_xmu.data<float>());
}

void cpu::batchnorm_backward_apply(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                   const Tensor& invstd, const Tensor& gamma, const Tensor& sum_dy,
                                   const Tensor& sum_dy_xmu, double count, Tensor& dx) {
  const char* op = "batchnorm_backward_apply";
  const BnGeometry g = bn_geometry(op, "x", x);
  const BackwardApplyArgs a =
      backward_apply_args(op, g, dy, x, mean, invstd, gamma, sum_dy, sum_dy_xmu, count, dx);
  cpu::use_configured_threads();
  backward_apply_planes<false, false>(g, a);
}

void cpu::batchnorm_backward_apply_relu(const Tensor& dy, const Tensor& y, const Tensor& x,
                                        const Tensor& mean, const Tensor& invstd,
                                        const Tensor& gamma, const Tensor& sum_dy,
                                        const Tensor& sum_dy_xmu, double count, Tensor& dx,
                                        Tensor& dmasked) {
  const char* op = "batchnorm_backward_apply_relu";
  const BnGeometry g = bn_geometry(op, "x", x);
  BackwardApplyArgs a =
      backward_apply_args(op, g, dy, x, mean, invstd, gamma, sum_dy, sum_dy_xmu, count, dx);
  cpu::check_float_shape(op, "y", y, x.shape());
  a.y = y.data<float>();
  cpu::use_configured_threads();
  if (dmasked.defined()) {
    cpu::check_float_shape(op, "dmasked", dmasked, x.shape());
    a.dmasked = dmasked.data<float>();
    backward_apply_planes<true, true>(g, a);
  } else {
    backward_apply_planes<true, false>(g, a);
  }
}

}  // namespace mtrain::ops
