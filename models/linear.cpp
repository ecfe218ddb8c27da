#include "models/linear.h"

#include "core/error.h"
#include "models/init.h"
#include "models/input_checks.h"
#include "tensor/ops.h"

namespace mtrain::models {

Linear::Linear(int64_t in_features, int64_t out_features, bool bias)
    : in_features_(in_features),
      out_features_(out_features),
      has_bias_(bias),
      description_(fmt::format("Linear(in_features={}, out_features={}, bias={})", in_features,
                               out_features, bias)) {
  if (in_features < 1 || out_features < 1) {
    throw InvalidArgument(fmt::format("{}: expected in_features and out_features >= 1",
                                      description_));
  }
  register_parameter("weight", weight_, {out_features, in_features});
  if (bias) register_parameter("bias", bias_, {out_features});
}

void Linear::reset_parameters(ParameterInitializer& init) {
  init.init_weight(weight_.value, in_features_);
  if (has_bias_) init.init_bias(bias_.value, in_features_);
}

Tensor Linear::forward(const Tensor& given) {
  // [N, ..., in] as rows [R, in] (a view: tensors are contiguous).
  const bool rows = given.defined() && given.ndim() > 2 && given.size(given.ndim() - 1) == in_features_;
  const Tensor x = rows ? given.view({given.numel() / in_features_, in_features_}) : given;
  detail::check_matrix_batch(description_, x, in_features_);
  detail::check_input_device(description_, x, weight_.value);
  Tensor y = Tensor::empty({x.size(0), out_features_}, DType::Float32, x.device());
  ops::linear_forward(x, weight_.value, bias_.value, y, compute_);
  input_ = x;
  input_shape_ = given.shape();
  output_shape_ = given.shape();
  output_shape_.back() = out_features_;
  return y.view(output_shape_);
}

Tensor Linear::backward(const Tensor& given) {
  detail::check_output_grad(description_, given, output_shape_);
  detail::check_output_grad_device(description_, given, input_.device());
  const Tensor dy = given.view({input_.size(0), out_features_});
  // One kernel call produces dx, dw and db together; the hook fires right after it.
  Tensor dx = input_grad_needed() ? Tensor::empty(input_.shape(), input_.dtype(), input_.device())
                                  : Tensor();  // undefined: not computed
  // One flag covers both gradients (Note [Gradient accumulation in modules]).
  const bool weight_fresh = take_fresh(weight_);
  const bool bias_fresh = !has_bias_ || take_fresh(bias_);
  ops::linear_backward(input_, weight_.value, dy, dx, weight_.grad, bias_.grad,
                       /*accumulate=*/!(weight_fresh && bias_fresh), compute_);
  if (has_bias_) notify_grad_ready(bias_);
  notify_grad_ready(weight_);
  input_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  output_shape_ = {};
  return dx.defined() ? dx.view(input_shape_) : dx;
}

}  // namespace mtrain::models
