// ChannelScale: y[n, c, ...] = x[n, c, ...] * scale[c], scale a parameter of C values kept
// in the shape it was given (ConvNeXt's layer_scale is [C, 1, 1]) under the name it was
// given, so that its state_dict entry loads back into the module it came from.
#pragma once

#include <cstdint>
#include <string>

#include "models/module.h"

namespace mtrain::models {

class ChannelScale : public Module {
 public:
  // `shape` holds C values (all dimensions but one are 1).
  ChannelScale(const std::string& parameter_name, const Shape& shape);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "ChannelScale"; }
  void reset_parameters(ParameterInitializer& init) override;  // every scale 1

 private:
  int64_t channels_;
  std::string description_;
  Parameter scale_;
  Tensor input_;
};

}  // namespace mtrain::models
