#include "models/activation.h"

#include <cmath>

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
  detail::check_floating("ReLU", x);
  output_ = Tensor::empty(x.shape(), x.dtype(), x.device());
  ops::relu_forward(x, output_);
  return output_;
}

Tensor ReLU::backward(const Tensor& dy) {
  detail::check_output_grad("ReLU", dy, shape_of(output_));
  detail::check_output_grad_device("ReLU", dy, output_.device());
  Tensor dx = Tensor::empty(dy.shape(), output_.dtype(), dy.device());
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

namespace {

// The forward and backward of an activation that keeps its input.
template <class Forward>
Tensor keep_input_forward(const char* layer, const Tensor& x, Tensor& input, Forward forward) {
  check_float_input(layer, x);
  input = x;
  Tensor y = Tensor::empty(x.shape(), DType::Float32, x.device());
  forward(x, y);
  return y;
}

template <class Backward>
Tensor keep_input_backward(const char* layer, const Tensor& dy, Tensor& input, Backward backward) {
  detail::check_output_grad(layer, dy, shape_of(input));
  detail::check_output_grad_device(layer, dy, input.device());
  Tensor dx = Tensor::empty(dy.shape(), DType::Float32, dy.device());
  backward(input, dy, dx);
  input = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

}  // namespace

Hardtanh::Hardtanh(float lo, float hi) : lo_(lo), hi_(hi) {
  if (!(lo < hi)) throw InvalidArgument(fmt::format("Hardtanh: expected min < max, found {} and {}", lo, hi));
}

Tensor Hardtanh::forward(const Tensor& x) {
  return keep_input_forward("Hardtanh", x, input_,
                            [&](const Tensor& in, Tensor& y) { ops::hardtanh_forward(in, lo_, hi_, y); });
}

Tensor Hardtanh::backward(const Tensor& dy) {
  return keep_input_backward("Hardtanh", dy, input_, [&](const Tensor& in, const Tensor& g, Tensor& dx) {
    ops::hardtanh_backward(in, g, lo_, hi_, dx);
  });
}

Tensor Hardsigmoid::forward(const Tensor& x) {
  return keep_input_forward("Hardsigmoid", x, input_, ops::hardsigmoid_forward);
}

Tensor Hardsigmoid::backward(const Tensor& dy) {
  return keep_input_backward("Hardsigmoid", dy, input_, ops::hardsigmoid_backward);
}

Tensor Hardswish::forward(const Tensor& x) { return keep_input_forward("Hardswish", x, input_, ops::hardswish_forward); }

Tensor Hardswish::backward(const Tensor& dy) {
  return keep_input_backward("Hardswish", dy, input_, ops::hardswish_backward);
}

Tensor Erf::forward(const Tensor& x) { return keep_input_forward("Erf", x, input_, ops::erf_forward); }

Tensor Erf::backward(const Tensor& dy) { return keep_input_backward("Erf", dy, input_, ops::erf_backward); }

Affine::Affine(float scale, float shift) : scale_(scale), shift_(shift) {
  if (!std::isfinite(scale) || !std::isfinite(shift)) {
    throw InvalidArgument(fmt::format("Affine: expected a finite scale and shift, found {} and {}", scale, shift));
  }
}

Tensor Affine::forward(const Tensor& x) {
  check_float_input("Affine", x);
  input_shape_ = x.shape();
  Tensor y = Tensor::empty(x.shape(), DType::Float32, x.device());
  ops::affine(x, scale_, shift_, y);
  return y;
}

Tensor Affine::backward(const Tensor& dy) {
  detail::check_output_grad("Affine", dy, input_shape_);
  Tensor dx = Tensor::empty(dy.shape(), DType::Float32, dy.device());
  ops::affine(dy, scale_, 0.0f, dx);
  input_shape_ = {};  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

}  // namespace mtrain::models
