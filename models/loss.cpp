#include "models/loss.h"

#include "core/error.h"
#include "tensor/ops.h"

namespace mtrain::models {

LossResult CrossEntropyLoss::forward(const Tensor& logits, const Tensor& labels) {
  dlogits_ = Tensor();
  Tensor dlogits = logits.defined() ? Tensor::empty(logits.shape(), DType::Float32, logits.device()) : Tensor();
  const LossResult r = compute(logits, labels, dlogits);
  dlogits_ = dlogits;
  return r;
}

LossResult CrossEntropyLoss::value(const Tensor& logits, const Tensor& labels) const {
  Tensor none;
  return compute(logits, labels, none);
}

LossResult CrossEntropyLoss::compute(const Tensor& logits, const Tensor& labels, Tensor& dlogits) {
  if (!logits.defined() || logits.dtype() != DType::Float32 || logits.ndim() != 2 ||
      logits.size(0) < 1 || logits.size(1) < 1) {
    throw InvalidArgument(fmt::format(
        "CrossEntropyLoss: expected float32 logits [N, K] with N, K >= 1, found {}",
        logits.defined() ? logits.str() : "an undefined tensor"));
  }
  const int64_t n = logits.size(0);
  if (!labels.defined() || labels.dtype() != DType::Int64 || labels.shape() != Shape{n}) {
    throw InvalidArgument(fmt::format("CrossEntropyLoss: expected int64 labels [{}], found {}",
                                      n, labels.defined() ? labels.str() : "an undefined tensor"));
  }
  if (labels.device() != logits.device()) {
    throw InvalidArgument(fmt::format(
        "CrossEntropyLoss: the logits are on {} but the labels are on {}; move the labels with "
        ".to({}) before the loss",
        logits.device().str(), labels.device().str(), logits.device().str()));
  }
  const double sum = ops::cross_entropy(logits, labels, dlogits, 1.0f / static_cast<float>(n));
  return {sum / static_cast<double>(n), ops::count_correct(logits, labels), n};
}

Tensor CrossEntropyLoss::backward() const {
  if (!dlogits_.defined()) {
    throw InvalidArgument("CrossEntropyLoss: backward called before forward");
  }
  return dlogits_;
}

}  // namespace mtrain::models
