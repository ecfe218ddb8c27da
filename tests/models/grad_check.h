// Central finite differences for Module::backward. The scalar under test is
// L(x, params) = sum_i r_i * forward(x)_i with a fixed random r (all-ones would make
// e.g. batch norm's input gradient vanish identically), so backward(r) must give dL/dx
// and accumulate dL/dparam.
//
// Numeric derivative per element: (L(v + eps) - L(v - eps)) / (actual float distance
// between v + eps and v - eps), with L summed in double. An analytic value a passes
// against the numeric value n when |a - n| <= atol + rtol * max(|a|, |n|).
#pragma once

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "models/module.h"

namespace mtrain::models::testing {

inline Tensor uniform_tensor(const Shape& shape, std::mt19937_64& rng, float low = -1.0f,
                             float high = 1.0f) {
  std::uniform_real_distribution<float> dist(low, high);
  Tensor t = Tensor::empty(shape);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
  return t;
}

// Values with |v| in [0.2, 1] and a random sign: keeps ReLU inputs away from the kink.
inline Tensor away_from_zero_tensor(const Shape& shape, std::mt19937_64& rng) {
  Tensor t = uniform_tensor(shape, rng, 0.2f, 1.0f);
  std::bernoulli_distribution flip(0.5);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = flip(rng) ? -p[i] : p[i];
  return t;
}

// Distinct values 0.05 apart in random order: no ties within a pooling window, even
// after a perturbation of eps < 0.025.
inline Tensor distinct_values_tensor(const Shape& shape, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(shape);
  std::vector<float> values(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < values.size(); ++i) values[i] = -1.0f + 0.05f * static_cast<float>(i);
  std::shuffle(values.begin(), values.end(), rng);
  std::copy(values.begin(), values.end(), t.data<float>());
  return t;
}

struct GradCheckOptions {
  float eps = 1e-2f;
  double rtol = 1e-2;
  double atol = 2e-3;
};

// Empty when every element passes, else a description of the worst element.
inline std::string compare_gradients(const std::string& what, const std::vector<float>& analytic,
                                     const std::vector<double>& numeric,
                                     const GradCheckOptions& opt) {
  if (analytic.size() != numeric.size()) {
    return fmt::format("{}: {} analytic values but {} numeric", what, analytic.size(),
                       numeric.size());
  }
  double worst_excess = 0.0;  // how far the worst element is beyond its tolerance
  size_t worst = 0;
  for (size_t i = 0; i < analytic.size(); ++i) {
    const double a = analytic[i], n = numeric[i];
    if (!std::isfinite(a) || !std::isfinite(n)) {
      return fmt::format("{}: element {} analytic {} vs numeric {}", what, i, a, n);
    }
    const double excess =
        std::abs(a - n) - (opt.atol + opt.rtol * std::max(std::abs(a), std::abs(n)));
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (worst_excess <= 0.0) return "";
  return fmt::format("{}: element {} analytic {} vs numeric {}", what, worst, analytic[worst],
                     numeric[worst]);
}

inline double projected_loss(Module& m, const Tensor& x, const Tensor& r) {
  const Tensor y = m.forward(x);
  REQUIRE(y.shape() == r.shape());
  const float* py = y.data<float>();
  const float* pr = r.data<float>();
  double sum = 0.0;
  for (int64_t i = 0; i < y.numel(); ++i) sum += static_cast<double>(py[i]) * pr[i];
  return sum;
}

// d L / d target for every element of `target` (the input x or a parameter value).
inline std::vector<double> numeric_gradient(Module& m, const Tensor& x, const Tensor& r,
                                            Tensor& target, float eps) {
  std::vector<double> out(static_cast<size_t>(target.numel()));
  float* p = target.data<float>();
  for (int64_t i = 0; i < target.numel(); ++i) {
    const float saved = p[i];
    const float plus = saved + eps, minus = saved - eps;
    p[i] = plus;
    const double loss_plus = projected_loss(m, x, r);
    p[i] = minus;
    const double loss_minus = projected_loss(m, x, r);
    p[i] = saved;
    out[static_cast<size_t>(i)] = (loss_plus - loss_minus) / (static_cast<double>(plus) - minus);
  }
  return out;
}

struct AnalyticGradients {
  Tensor projection;  // r
  std::vector<float> input;
  std::vector<std::pair<std::string, std::vector<float>>> params;
};

// One forward and backward(r) from zeroed gradients.
inline AnalyticGradients analytic_gradients(Module& m, const Tensor& x, std::mt19937_64& rng) {
  m.zero_grad();
  const Tensor y = m.forward(x);
  AnalyticGradients g;
  g.projection = uniform_tensor(y.shape(), rng);
  const Tensor dx = m.backward(g.projection);
  REQUIRE(dx.shape() == x.shape());
  g.input = dx.to_vector<float>();
  for (const NamedParameter& p : m.parameters()) {
    g.params.emplace_back(p.name, p.param->grad.to_vector<float>());
  }
  return g;
}

// Returns one line per failing tensor (empty = all gradients match).
inline std::vector<std::string> check_module_gradients(Module& m, const Tensor& x,
                                                       std::mt19937_64& rng,
                                                       const GradCheckOptions& opt = {}) {
  const AnalyticGradients g = analytic_gradients(m, x, rng);
  std::vector<std::string> failures;
  Tensor input = x.clone();
  const std::string input_failure = compare_gradients(
      "input", g.input, numeric_gradient(m, input, g.projection, input, opt.eps), opt);
  if (!input_failure.empty()) failures.push_back(input_failure);
  size_t i = 0;
  for (const NamedParameter& p : m.parameters()) {
    const std::string failure =
        compare_gradients(p.name, g.params[i++].second,
                          numeric_gradient(m, x, g.projection, p.param->value, opt.eps), opt);
    if (!failure.empty()) failures.push_back(failure);
  }
  return failures;
}

}  // namespace mtrain::models::testing
