#include "models/channel_scale.h"

#include "core/error.h"
#include "models/input_checks.h"
#include "tensor/ops.h"

namespace mtrain::models {

ChannelScale::ChannelScale(const std::string& parameter_name, const Shape& shape)
    : channels_(shape_numel(shape)),
      description_(fmt::format("ChannelScale({} [{}])", parameter_name, fmt::join(shape, ", "))) {
  const int ones = static_cast<int>(std::count(shape.begin(), shape.end(), int64_t{1}));
  if (channels_ < 1 || (channels_ > 1 && ones != static_cast<int>(shape.size()) - 1)) {
    throw InvalidArgument(fmt::format("{}: expected a shape of C values, all dimensions but one 1", description_));
  }
  register_parameter(parameter_name, scale_, shape);
  scale_.value.fill_(1.0f);
}

void ChannelScale::reset_parameters(ParameterInitializer&) { scale_.value.fill_(1.0f); }

Tensor ChannelScale::forward(const Tensor& x) {
  if (!x.defined() || x.dtype() != DType::Float32 || x.ndim() < 2 || x.size(1) != channels_) {
    throw InvalidArgument(fmt::format("{}: expected float32 input [N, {}, ...], found {}", description_, channels_,
                                      x.defined() ? x.str() : "an undefined tensor"));
  }
  detail::check_input_device(description_, x, scale_.value);
  input_ = x;
  Tensor y = Tensor::empty(x.shape(), DType::Float32, x.device());
  ops::scale_channels(x, scale_.value, y);
  return y;
}

Tensor ChannelScale::backward(const Tensor& dy) {
  detail::check_output_grad(description_, dy, input_.defined() ? input_.shape() : Shape{});
  detail::check_output_grad_device(description_, dy, input_.device());
  Tensor grad = Tensor::empty(scale_.grad.shape(), DType::Float32, dy.device());
  ops::channel_dot(dy, input_, grad);
  ops::add_(scale_.grad, grad, 1.0f);  // as batch norm does (Note [Gradient accumulation in modules])
  notify_grad_ready(scale_);
  Tensor dx = Tensor::empty(dy.shape(), DType::Float32, dy.device());
  ops::scale_channels(dy, scale_.value, dx);
  input_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

}  // namespace mtrain::models
