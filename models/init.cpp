#include "models/init.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

// Note [Initialisation]
// ~~~~~~~~~~~~~~~~~~~~~
// kPyTorchDefault reproduces torch's reset_parameters distributions: conv and linear weights
// kaiming_uniform(a = sqrt(5)), which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and biases
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in_features or in_channels*kh*kw. kNormal is d2l's
// init_normal: conv and linear weights N(0, 0.01^2), biases zero. Either way BatchNorm gets weight
// 1, bias 0, running mean 0, running var 1 and num_batches_tracked 0. Layer constructors only
// allocate (conv and linear parameters are zero); build_model calls init_parameters, and code that
// assembles layers itself must too. Seeding each layer in its constructor would either need an RNG
// argument on every constructor or give same-shaped layers identical weights.
//
// Values come from one std::mt19937_64 seeded with InitOptions::seed and consumed in parameter
// order (Note [Parameter names]): the same seed gives the same model. Uniform and normal draws are
// computed here from the raw 64-bit output (top 24 bits for a float in [0, 1), Box-Muller for
// normals) rather than with std:: distributions, whose algorithms differ between standard
// libraries. Bit parity with torch's generator is a non-goal: torch.manual_seed(s) and seed s give
// different (equally distributed) values. Values are drawn on the host, so a model initialised on
// the CPU and moved with Module::to starts from the same weights on every device; an initializer
// given a GPU tensor draws the same values into host memory and copies them over.

namespace mtrain::models {

ParameterInitializer::ParameterInitializer(const InitOptions& options)
    : scheme_(options.scheme), rng_(options.seed) {}

void ParameterInitializer::init_weight(Tensor& weight, int64_t fan_in) {
  MTRAIN_CHECK(fan_in > 0, "fan_in {} for {}", fan_in, weight.str());
  if (scheme_ == InitScheme::kNormal) {
    fill_normal(weight, 0.0f, 0.01f);
  } else if (scheme_ == InitScheme::kXavier) {
    // nn.init.xavier_uniform_ with gain 1: U(-a, a), a = sqrt(6 / (fan_in + fan_out)),
    // fan_out = out_channels x receptive field = numel / in_channels.
    MTRAIN_CHECK(weight.shape().size() >= 2, "xavier init of {}: expected [out, in, ...]", weight.str());
    const int64_t fan_out = weight.numel() / weight.shape()[1];
    const float bound = std::sqrt(6.0f / static_cast<float>(fan_in + fan_out));
    fill_uniform(weight, -bound, bound);
  } else {
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    fill_uniform(weight, -bound, bound);
  }
}

void ParameterInitializer::init_bias(Tensor& bias, int64_t fan_in) {
  MTRAIN_CHECK(fan_in > 0, "fan_in {} for {}", fan_in, bias.str());
  if (scheme_ == InitScheme::kNormal) {
    bias.zero_();
  } else {
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    fill_uniform(bias, -bound, bound);
  }
}

float ParameterInitializer::next_unit_float() {
  return static_cast<float>(rng_() >> 40) * 0x1.0p-24f;
}

namespace {
// The values are always drawn into host memory (see Note [Initialisation]); a tensor on
// a GPU gets them through a host tensor and one copy.
template <class Fill>
void fill_on_host(Tensor& t, const Fill& fill) {
  if (t.device().is_cpu()) {
    fill(t.data<float>());
    return;
  }
  Tensor host = Tensor::empty(t.shape(), t.dtype());
  fill(host.data<float>());
  t.copy_(host);
}
}  // namespace

void ParameterInitializer::fill_uniform(Tensor& t, float low, float high) {
  fill_on_host(t, [&](float* p) {
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = low + (high - low) * next_unit_float();
  });
}

void ParameterInitializer::fill_normal(Tensor& t, float mean, float stddev) {
  fill_on_host(t, [&](float* p) {
    const int64_t n = t.numel();
    for (int64_t i = 0; i < n; i += 2) {
      // Box-Muller: 1 - u is in (0, 1], so the log is finite.
      const double u1 = 1.0 - next_unit_float();
      const double u2 = next_unit_float();
      const double radius = std::sqrt(-2.0 * std::log(u1));
      const double angle = 2.0 * std::numbers::pi * u2;
      p[i] = static_cast<float>(mean + stddev * radius * std::cos(angle));
      if (i + 1 < n) p[i + 1] = static_cast<float>(mean + stddev * radius * std::sin(angle));
    }
  });
}

void init_parameters(Module& root, const InitOptions& options) {
  if (options.scheme == InitScheme::kGraph) return;  // the graph's values stay
  ParameterInitializer init(options);
  for (auto& [name, module] : root.named_modules()) module->reset_parameters(init);
}

}  // namespace mtrain::models
