#include "models/dropout.h"

#include "core/error.h"
#include "models/input_checks.h"
#include "tensor/ops.h"

namespace mtrain::models {

Dropout::Dropout(float p, uint64_t seed) : p_(p), seed_(seed) {
  if (!(p >= 0.0f && p < 1.0f)) throw InvalidArgument(fmt::format("Dropout: expected p in [0, 1), found {}", p));
}

Tensor Dropout::forward(const Tensor& x) {
  mask_ = Tensor();
  if (!is_training() || p_ == 0.0f) return x;
  if (!x.defined() || x.dtype() != DType::Float32) {
    throw InvalidArgument(fmt::format("Dropout: expected a float32 input, found {}", x.defined() ? x.str() : "none"));
  }
  mask_ = Tensor::empty(x.shape(), DType::Float32, x.device());
  // A distinct stream of draws per forward: the seed's high bits carry the count.
  ops::dropout_mask(mask_, p_, seed_ ^ (draws_++ << 32));
  Tensor y = Tensor::empty(x.shape(), DType::Float32, x.device());
  ops::mul(x, mask_, y);
  return y;
}

Tensor Dropout::backward(const Tensor& dy) {
  if (!mask_.defined()) return dy;
  detail::check_output_grad("Dropout", dy, mask_.shape());
  detail::check_output_grad_device("Dropout", dy, mask_.device());
  Tensor dx = Tensor::empty(dy.shape(), DType::Float32, dy.device());
  ops::mul(dy, mask_, dx);
  mask_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

}  // namespace mtrain::models
