// LayerNorm over the last dimension (torch.nn.LayerNorm(features) with an affine weight and
// bias): each [..., features] row normalised by its own mean and variance (ops.h's
// layer_norm_forward). ConvNeXt normalises its channels-last images so.
#pragma once

#include <cstdint>

#include "models/module.h"

namespace mtrain::models {

class LayerNorm : public Module {
 public:
  LayerNorm(int64_t features, float eps = 1e-5f);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "LayerNorm"; }
  void reset_parameters(ParameterInitializer& init) override;  // weight 1, bias 0

 private:
  int64_t features_;
  float eps_;
  std::string description_;
  Parameter weight_;
  Parameter bias_;
  Tensor input_;  // as rows [R, features]
  Tensor mean_, rstd_;
  Shape shape_;   // the input's, as given
};

}  // namespace mtrain::models
