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

// The piecewise-linear activations of mobile networks, as torch.nn's (formulas in
// tensor/ops.h). They keep their *input* for backward. Hardtanh(0, 6) is ReLU6.
class Hardtanh : public Module {
 public:
  Hardtanh(float lo, float hi);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Hardtanh"; }

 private:
  float lo_, hi_;
  Tensor input_;
};

class Hardsigmoid : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Hardsigmoid"; }

 private:
  Tensor input_;
};

class Hardswish : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Hardswish"; }

 private:
  Tensor input_;
};

// y = erf(x) (GELU's exports compute with it); keeps its input for backward.
class Erf : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Erf"; }

 private:
  Tensor input_;
};

// y = x * scale + shift: arithmetic with a constant number (ONNX's Add, Sub, Mul, Div).
class Affine : public Module {
 public:
  Affine(float scale, float shift);
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Affine"; }

 private:
  float scale_, shift_;
  Shape input_shape_;
};

}  // namespace mtrain::models
