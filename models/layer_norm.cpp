#include "models/layer_norm.h"

#include <cmath>

#include "core/error.h"
#include "models/input_checks.h"
#include "tensor/ops.h"

namespace mtrain::models {

LayerNorm::LayerNorm(int64_t features, float eps)
    : features_(features), eps_(eps), description_(fmt::format("LayerNorm(({},), eps={})", features, eps)) {
  if (features < 1 || !(eps > 0.0f) || !std::isfinite(eps)) {
    throw InvalidArgument(fmt::format("{}: expected features >= 1 and a finite eps > 0", description_));
  }
  register_parameter("weight", weight_, {features});
  register_parameter("bias", bias_, {features});
  weight_.value.fill_(1.0f);
  bias_.value.zero_();
}

void LayerNorm::reset_parameters(ParameterInitializer&) {
  weight_.value.fill_(1.0f);
  bias_.value.zero_();
}

Tensor LayerNorm::forward(const Tensor& x) {
  if (!x.defined() || x.dtype() != DType::Float32 || x.ndim() < 1 || x.size(x.ndim() - 1) != features_) {
    throw InvalidArgument(fmt::format("{}: expected float32 input [..., {}], found {}", description_, features_,
                                      x.defined() ? x.str() : "an undefined tensor"));
  }
  detail::check_input_device(description_, x, weight_.value);
  const int64_t rows = x.numel() / features_;
  input_ = x.view({rows, features_});
  shape_ = x.shape();
  Tensor y = Tensor::empty(input_.shape(), DType::Float32, x.device());
  mean_ = Tensor::empty({rows}, DType::Float32, x.device());
  rstd_ = Tensor::empty({rows}, DType::Float32, x.device());
  ops::layer_norm_forward(input_, weight_.value, bias_.value, eps_, y, mean_, rstd_);
  return y.view(shape_);
}

Tensor LayerNorm::backward(const Tensor& dy) {
  detail::check_output_grad(description_, dy, input_.defined() ? shape_ : Shape{});
  detail::check_output_grad_device(description_, dy, input_.device());
  Tensor dx = Tensor::empty(input_.shape(), DType::Float32, dy.device());
  Tensor dw = Tensor::empty({features_}, DType::Float32, dy.device());
  Tensor db = Tensor::empty({features_}, DType::Float32, dy.device());
  ops::layer_norm_backward(input_, dy.view(input_.shape()), weight_.value, mean_, rstd_, dx, dw, db);
  // Added to the gradients, as batch norm does (Note [Gradient accumulation in modules]).
  ops::add_(weight_.grad, dw, 1.0f);
  ops::add_(bias_.grad, db, 1.0f);
  notify_grad_ready(bias_);
  notify_grad_ready(weight_);
  input_ = mean_ = rstd_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  return dx.view(shape_);
}

}  // namespace mtrain::models
