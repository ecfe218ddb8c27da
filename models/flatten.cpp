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
  detail::check_output_grad("Flatten", dy, output_shape_);
  return dy.view(input_shape_);
}

}  // namespace mtrain::models
