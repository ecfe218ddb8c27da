#include "models/identity.h"

#include "models/input_checks.h"

namespace mtrain::models {

Tensor Identity::forward(const Tensor& x) {
  shape_ = x.defined() ? x.shape() : Shape{};
  return x;
}

Tensor Identity::backward(const Tensor& dy) {
  detail::check_output_grad("Identity", dy, shape_);  // an empty shape: no forward before
  shape_ = {};  // Note [Saved tensors die with backward] (module.cpp)
  return dy;
}

}  // namespace mtrain::models
