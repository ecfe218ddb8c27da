#include "models/flatten.h"

#include "core/error.h"
#include "models/input_checks.h"

namespace mtrain::models {

Tensor Flatten::forward(const Tensor& x) {
  if (!x.defined() || x.ndim() < 1) {
    throw InvalidArgument(fmt::format("Flatten: expected an input with a batch dimension, found {}",
                                      x.defined() ? x.str() : "an undefined tensor"));
  }
  int64_t features = 1;
  for (int d = 1; d < x.ndim(); ++d) features *= x.size(d);
  input_shape_ = x.shape();
  output_shape_ = {x.size(0), features};
  return x.view(output_shape_);
}

Tensor Flatten::backward(const Tensor& dy) {
  if (!input_grad_needed()) {
    // The layer after it skipped its input gradient too (passes_input_grad_setting).
    if (output_shape_.empty()) detail::check_output_grad("Flatten", dy, output_shape_);  // backward before forward
    output_shape_ = {};
    return Tensor();
  }
  detail::check_output_grad("Flatten", dy, output_shape_);
  Tensor dx = dy.view(input_shape_);
  output_shape_ = {};  // Note [Saved tensors die with backward] (module.cpp): a second backward is an error
  return dx;
}

}  // namespace mtrain::models
