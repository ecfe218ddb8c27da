// Parameter initialisation.
//
// Note [Initialisation]
// ~~~~~~~~~~~~~~~~~~~~~
// kPyTorchDefault reproduces torch's reset_parameters distributions: conv and linear
// weights kaiming_uniform(a = sqrt(5)), which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and
// biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in_features or in_channels*kh*kw.
// kNormal is d2l's init_normal: conv and linear weights N(0, 0.01^2), biases zero.
// Either way BatchNorm gets weight 1, bias 0, running mean 0, running var 1 and
// num_batches_tracked 0. Layer constructors only allocate (conv and linear parameters
// are zero); build_model calls init_parameters, and code that assembles layers itself
// must too. Seeding each layer in its constructor would either need an RNG argument on
// every constructor or give same-shaped layers identical weights.
//
// Values come from one std::mt19937_64 seeded with InitOptions::seed and consumed in
// parameter order (Note [Parameter names]): the same seed gives the same model.
// Uniform and normal draws are computed here from the raw 64-bit output (top 24 bits for
// a float in [0, 1), Box-Muller for normals) rather than with std:: distributions, whose
// algorithms differ between standard libraries. Bit parity with torch's generator is a
// non-goal: torch.manual_seed(s) and seed s give different (equally distributed) values.
// Values are drawn on the host, so a model initialised on the CPU and moved with
// Module::to starts from the same weights on every device; an initializer given a GPU
// tensor draws the same values into host memory and copies them over.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "models/module.h"

namespace mtrain::models {

enum class InitScheme { kPyTorchDefault, kNormal };

// "default" -> kPyTorchDefault, "normal" -> kNormal; anything else is InvalidArgument.
InitScheme parse_init_scheme(const std::string& name);

struct InitOptions {
  InitScheme scheme = InitScheme::kPyTorchDefault;
  uint64_t seed = 0;
};

// What a layer's reset_parameters draws from.
class ParameterInitializer {
 public:
  explicit ParameterInitializer(const InitOptions& options);

  InitScheme scheme() const { return scheme_; }
  // A conv or linear weight with the given fan-in, per the scheme.
  void init_weight(Tensor& weight, int64_t fan_in);
  // A conv or linear bias whose layer has the given fan-in, per the scheme.
  void init_bias(Tensor& bias, int64_t fan_in);

  // Float32 tensors on any device: the values are drawn on the host in the same order
  // either way, then copied (Note [Initialisation]).
  void fill_uniform(Tensor& t, float low, float high);
  void fill_normal(Tensor& t, float mean, float stddev);

 private:
  float next_unit_float();  // uniform in [0, 1)

  InitScheme scheme_;
  std::mt19937_64 rng_;
};

// Calls reset_parameters on every module of the subtree in pre-order.
void init_parameters(Module& root, const InitOptions& options);

}  // namespace mtrain::models
