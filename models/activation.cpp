#include "models/activation.h"

#include "core/error.h"
#include "models/input_checks.h"
#include "tensor/ops.h"

namespace mtrain::models {

namespace {
void check_float_input(const char* layer, const Tensor& x) {
  if (!x.defined() || x.dtype() != DType::Float32) {
    throw InvalidArgument(fmt::format("{}: expected a float32 input, found {}", layer,
                                      x.defined() ? x.str() : "an undefined tensor"));
  }
}

Shape shape_of(const Tensor& t) { return t.defined() ? t.shape() : Shape{}; }
}  // namespace

Tensor ReLU::forward(const Tensor& x) {
  check_float_input("ReLU", x);
  output_ = Tensor::empty(x.shape(), DType::Float32, x.device());
  ops::relu_forward(x, output_);
  return output_;
}

Tensor ReLU::backward(const Tensor& dy) {
  detail::check_output_grad("ReLU", dy, shape_of(output_));
  detail::check_output_grad_device("ReLU", dy, output_.device());
  Tensor dx = Tensor::empty(dy.shape(), DType::Float32, dy.device());
  ops::relu_backward(output_, dy, dx);
  output_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

Tensor Sigmoid::forward(const Tensor& x) {
  check_float_input("Sigmoid", x);
  output_ = Tensor::empty(x.shape(), DType::Float32, x.device());
  ops::sigmoid_forward(x, output_);
  return output_;
}

Tensor Sigmoid::backward(const Tensor& dy) {
  detail::check_output_grad("Sigmoid", dy, shape_of(output_));
  detail::check_output_grad_device("Sigmoid", dy, output_.device());
  Tensor dx = Tensor::empty(dy.shape(), DType::Float32, dy.device());
  ops::sigmoid_backward(output_, dy, dx);
  output_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

}  // namespace mtrain::models
