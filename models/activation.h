// Elementwise activations. Both keep their *output* for backward (the derivative of
// ReLU and of the sigmoid is a function of the output).
#pragma once

#include "models/module.h"

namespace mtrain::models {

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "ReLU"; }

 private:
  Tensor output_;
};

class Sigmoid : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Sigmoid"; }

 private:
  Tensor output_;
};

}  // namespace mtrain::models
