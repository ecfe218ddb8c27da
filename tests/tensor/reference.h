// Straightforward reference implementations of the CPU kernels (naive loops,
// double accumulation) and helpers for comparing tensors, for the tensor tests.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace mtrain::testing {

// Uniform values in [lo, hi) from a fixed seed, so failures reproduce.
inline Tensor random_tensor(const Shape& shape, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Tensor t = Tensor::empty(shape);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(gen);
  return t;
}

inline std::vector<double> to_double(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<double>(p, p + t.numel());
}

// Every element within atol + rtol * |expected|; reports the first mismatch.
inline void require_close(const Tensor& actual, const std::vector<double>& expected,
                          double atol = 1e-5, double rtol = 1e-5) {
  REQUIRE(actual.numel() == static_cast<int64_t>(expected.size()));
  const float* p = actual.data<float>();
  for (size_t i = 0; i < expected.size(); ++i) {
    const double tol = atol + rtol * std::fabs(expected[i]);
    if (!(std::fabs(p[i] - expected[i]) <= tol)) {
      FAIL("element " << i << " of " << actual.str() << ": got " << p[i] << ", expected "
                      << expected[i] << " (tolerance " << tol << ")");
    }
  }
}

inline void require_close(const Tensor& actual, const Tensor& expected, double atol = 1e-5,
                          double rtol = 1e-5) {
  REQUIRE(actual.shape() == expected.shape());
  require_close(actual, to_double(expected), atol, rtol);
}

// Largest |actual - expected| over the float32 elements (same shapes).
inline double max_abs_gap(const Tensor& actual, const Tensor& expected) {
  REQUIRE(actual.shape() == expected.shape());
  double m = 0.0;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(actual.data<float>()[i]) - expected.data<float>()[i]));
  }
  return m;
}

// Every bit equal, on any devices (== on floats would pass -0 for 0 and fail NaN against
// NaN); names the first element that differs.
inline void require_same_bits(const Tensor& actual, const Tensor& expected) {
  const Tensor got = actual.to(Device::cpu());
  const Tensor want = expected.to(Device::cpu());
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  const size_t width = dtype_size(got.dtype());
  const auto* a = static_cast<const unsigned char*>(got.raw_data());
  const auto* b = static_cast<const unsigned char*>(want.raw_data());
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(a + i * width, b + i * width, width) != 0) {
      if (got.dtype() == DType::Float32) {
        FAIL("element " << i << " of " << actual.str() << ": " << got.data<float>()[i] << ", expected "
                        << want.data<float>()[i]);
      }
      FAIL("element " << i << " of " << actual.str() << " differs");
    }
  }
}

// sum_i a[i] * b[i] in double: the scalar "loss" whose gradient a backward op computes.
inline double dot(const Tensor& a, const Tensor& b) {
  REQUIRE(a.numel() == b.numel());
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  double s = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(pa[i]) * pb[i];
  return s;
}

// Central finite differences of loss() with respect to every element of `x`, which
// loss() reads. `eps` may be large for functions linear in x (the difference is exact).
template <class Loss>
std::vector<double> finite_difference(Tensor& x, Loss loss, float eps) {
  std::vector<double> grad(static_cast<size_t>(x.numel()));
  float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float saved = p[i];
    p[i] = saved + eps;
    const double up = loss();
    p[i] = saved - eps;
    const double down = loss();
    p[i] = saved;
    grad[static_cast<size_t>(i)] = (up - down) / (2.0 * static_cast<double>(eps));
  }
  return grad;
}

// ---- convolution -----------------------------------------------------------------
inline std::vector<double> conv2d_ref(const Tensor& x, const Tensor& w, const Tensor& b,
                                      const ops::Conv2dParams& p) {
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  const int64_t o = w.size(0), kh = w.size(2), kw = w.size(3);
  const int64_t oh = (h + 2 * p.pad_h - (p.dilation_h * (kh - 1) + 1)) / p.stride_h + 1;
  const int64_t ow = (wd + 2 * p.pad_w - (p.dilation_w * (kw - 1) + 1)) / p.stride_w + 1;
  const float* px = x.data<float>();
  const float* pw = w.data<float>();
  std::vector<double> y(static_cast<size_t>(n * o * oh * ow));
  for (int64_t in = 0; in < n; ++in)
    for (int64_t oc = 0; oc < o; ++oc)
      for (int64_t oy = 0; oy < oh; ++oy)
        for (int64_t ox = 0; ox < ow; ++ox) {
          double s = b.defined() ? b.data<float>()[oc] : 0.0;
          for (int64_t ic = 0; ic < c; ++ic)
            for (int64_t ky = 0; ky < kh; ++ky)
              for (int64_t kx = 0; kx < kw; ++kx) {
                const int64_t iy = oy * p.stride_h - p.pad_h + ky * p.dilation_h;
                const int64_t ix = ox * p.stride_w - p.pad_w + kx * p.dilation_w;
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                s += static_cast<double>(px[((in * c + ic) * h + iy) * wd + ix]) *
                     pw[((oc * c + ic) * kh + ky) * kw + kx];
              }
          y[static_cast<size_t>(((in * o + oc) * oh + oy) * ow + ox)] = s;
        }
  return y;
}

// dx and dw of sum(conv(x, w) * dy), by scattering each output's gradient.
struct ConvGradRef {
  std::vector<double> dx, dw, db;
};
inline ConvGradRef conv2d_backward_ref(const Tensor& x, const Tensor& w, const Tensor& dy,
                                       const ops::Conv2dParams& p) {
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  const int64_t o = w.size(0), kh = w.size(2), kw = w.size(3);
  const int64_t oh = dy.size(2), ow = dy.size(3);
  const float* px = x.data<float>();
  const float* pw = w.data<float>();
  const float* pdy = dy.data<float>();
  ConvGradRef g{std::vector<double>(static_cast<size_t>(x.numel())),
                std::vector<double>(static_cast<size_t>(w.numel())),
                std::vector<double>(static_cast<size_t>(o))};
  for (int64_t in = 0; in < n; ++in)
    for (int64_t oc = 0; oc < o; ++oc)
      for (int64_t oy = 0; oy < oh; ++oy)
        for (int64_t ox = 0; ox < ow; ++ox) {
          const double d = pdy[((in * o + oc) * oh + oy) * ow + ox];
          g.db[static_cast<size_t>(oc)] += d;
          for (int64_t ic = 0; ic < c; ++ic)
            for (int64_t ky = 0; ky < kh; ++ky)
              for (int64_t kx = 0; kx < kw; ++kx) {
                const int64_t iy = oy * p.stride_h - p.pad_h + ky * p.dilation_h;
                const int64_t ix = ox * p.stride_w - p.pad_w + kx * p.dilation_w;
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                const int64_t xi = ((in * c + ic) * h + iy) * wd + ix;
                const int64_t wi = ((oc * c + ic) * kh + ky) * kw + kx;
                g.dx[static_cast<size_t>(xi)] += d * pw[wi];
                g.dw[static_cast<size_t>(wi)] += d * px[xi];
              }
        }
  return g;
}

// ---- pooling ------------------------------------------------------------------------
// Max (is_max) or average (count_include_pad) pooling of every plane.
inline std::vector<double> pool2d_ref(const Tensor& x, const ops::Pool2dParams& p, bool is_max) {
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = (h + 2 * p.pad_h - p.kernel_h) / p.stride_h + 1;
  const int64_t ow = (w + 2 * p.pad_w - p.kernel_w) / p.stride_w + 1;
  const float* px = x.data<float>();
  std::vector<double> y;
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t oy = 0; oy < oh; ++oy)
      for (int64_t ox = 0; ox < ow; ++ox) {
        double best = -INFINITY, sum = 0.0;
        for (int64_t ky = 0; ky < p.kernel_h; ++ky)
          for (int64_t kx = 0; kx < p.kernel_w; ++kx) {
            const int64_t iy = oy * p.stride_h - p.pad_h + ky;
            const int64_t ix = ox * p.stride_w - p.pad_w + kx;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
            const double v = px[(pl * h + iy) * w + ix];
            best = std::max(best, v);
            sum += v;
          }
        y.push_back(is_max ? best : sum / (p.kernel_h * p.kernel_w));
      }
  return y;
}

// ---- matmul ---------------------------------------------------------------------------
// alpha * op(a) @ op(b) + beta * c0.
inline std::vector<double> matmul_ref(const Tensor& a, bool ta, const Tensor& b, bool tb,
                                      const Tensor& c0, float alpha, float beta) {
  const int64_t m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1);
  const int64_t n = tb ? b.size(0) : b.size(1);
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  const float* pc = c0.data<float>();
  std::vector<double> c(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t l = 0; l < k; ++l) {
        const double av = ta ? pa[l * m + i] : pa[i * k + l];
        const double bv = tb ? pb[j * k + l] : pb[l * n + j];
        s += av * bv;
      }
      c[static_cast<size_t>(i * n + j)] = alpha * s + beta * pc[i * n + j];
    }
  return c;
}

// ---- batch norm ---------------------------------------------------------------------
struct BnStatsRef {
  std::vector<double> mean, var;
};
inline BnStatsRef batchnorm_stats_ref(const Tensor& x) {
  const int64_t n = x.size(0), c = x.size(1), area = x.numel() / std::max<int64_t>(1, n * c);
  const float* px = x.data<float>();
  BnStatsRef r{std::vector<double>(static_cast<size_t>(c)), std::vector<double>(static_cast<size_t>(c))};
  const double count = static_cast<double>(n * area);
  for (int64_t ch = 0; ch < c && count > 0; ++ch) {
    double s = 0.0;
    for (int64_t in = 0; in < n; ++in)
      for (int64_t i = 0; i < area; ++i) s += px[(in * c + ch) * area + i];
    const double mean = s / count;
    double sq = 0.0;
    for (int64_t in = 0; in < n; ++in)
      for (int64_t i = 0; i < area; ++i) {
        const double d = px[(in * c + ch) * area + i] - mean;
        sq += d * d;
      }
    r.mean[static_cast<size_t>(ch)] = mean;
    r.var[static_cast<size_t>(ch)] = sq / count;
  }
  return r;
}

}  // namespace mtrain::testing
