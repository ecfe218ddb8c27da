#include "models/flatten.h"

#include "core/error.h"
#include "models/input_checks.h"
#include "models/layout.h"

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
  // Channels last: into [N, C, H, W] first (a view where that moves nothing).
  const bool relayout = channels_last_ && x.ndim() == 4;
  return (relayout ? channels_first_copy(x) : x).view(output_shape_);
}

Tensor Flatten::backward(const Tensor& dy) {
  if (!input_grad_needed()) {
    // The layer after it skipped its input gradient too (passes_input_grad_setting).
    if (output_shape_.empty()) detail::check_output_grad("Flatten", dy, output_shape_);  // backward before forward
    output_shape_ = {};
    return Tensor();
  }
  detail::check_output_grad("Flatten", dy, output_shape_);
  const Shape& s = input_shape_;
  Tensor dx = channels_last_ && s.size() == 4 ? channels_last_copy(dy.view({s[0], s[3], s[1], s[2]}))
                                               : dy.view(input_shape_);
  output_shape_ = {};  // Note [Saved tensors die with backward] (module.cpp): a second backward is an error
  return dx;
}

}  // namespace mtrain::models
