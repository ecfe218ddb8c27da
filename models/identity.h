// Identity: returns its input (torch.nn.Identity). What a layer folded into its
// neighbour leaves in its place (fuse_batchnorm, models/rewrites.h), so the names of the
// modules around it stay those of the model as built.
#pragma once

#include "models/module.h"

namespace mtrain::models {

class Identity : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Identity"; }

 private:
  Shape shape_;  // of the last forward's input, until its backward
};

}  // namespace mtrain::models
