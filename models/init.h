// Parameter initialisation: torch's default distributions or d2l's normal init, drawn from one
// seeded generator in parameter order, so the same seed gives the same model on every rank,
// device and standard library (Note [Initialisation] in init.cpp). Layer constructors only
// allocate: code that assembles layers itself must call init_parameters.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "models/module.h"

namespace mtrain::models {

// kXavier: nn.init.xavier_uniform_ weights (d2l's LeNet recipe), PyTorch's default biases.
// kGraph: the values an ONNX graph brought (models/onnx/graph_model.h); init_parameters
// leaves them as they are.
enum class InitScheme { kPyTorchDefault, kNormal, kXavier, kGraph };

struct InitOptions {
  InitScheme scheme = InitScheme::kPyTorchDefault;
  uint64_t seed = 0;
};

// What a layer's reset_parameters draws from.
class ParameterInitializer {
 public:
  explicit ParameterInitializer(const InitOptions& options);

  InitScheme scheme() const { return scheme_; }
  // A conv or linear weight with the given fan-in, per the scheme (its fan-out, for
  // kXavier, comes from its shape: [out, in, k...]).
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
