#include "models/loss.h"

#include <cstring>

#include "core/error.h"
#include "tensor/ops.h"

namespace mtrain::models {

// Note [Loss statistics stay on the device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On a GPU, reading the loss makes the host wait until the GPU has finished the forward
// pass. Reading it the moment it is computed, before the backward is queued, would let the
// GPU run dry while the host then queues the backward's first kernels; a CUDA graph could
// not hold such a step either. So the loss kernels write the loss sum, the correct count
// and the first bad label's row into one small device tensor (ops::loss_stats), a copy of
// it to pinned host memory is queued right behind them, and the figures are read later:
// the training loop reads them once the backward is queued (Note [The loss is read after
// backward is queued] in trainer/loop/train_loop.cpp), the evaluation one batch behind.
// On the CPU the same tensor is ready when the call returns. A label outside [0, K) is
// reported when the figures are read: the kernels skip its row, and the gradient they
// wrote is never applied.
PendingLoss::PendingLoss(const Tensor& stats, const Tensor& labels, int64_t classes)
    : stats_(stats), labels_(labels), classes_(classes) {}

LossResult PendingLoss::read() const {
  const int64_t* words = stats_.wait().data<int64_t>();
  const int64_t n = labels_.numel();
  if (const int64_t row = words[2]; row >= 0) {
    const int64_t label = labels_.narrow0(row, 1).to_vector<int64_t>()[0];
    throw InvalidArgument(fmt::format("CrossEntropyLoss: label {} of sample {} is outside [0, {}): the data's "
                                      "classes do not match the model's {} outputs",
                                      label, row, classes_, classes_));
  }
  double sum = 0.0;
  std::memcpy(&sum, &words[0], sizeof(sum));
  return {sum / static_cast<double>(n), words[1], n};
}

PendingLoss CrossEntropyLoss::forward(const Tensor& logits, const Tensor& labels) {
  dlogits_ = Tensor();
  Tensor dlogits = logits.defined() ? Tensor::empty(logits.shape(), DType::Float32, logits.device()) : Tensor();
  PendingLoss r = compute(logits, labels, dlogits);
  dlogits_ = dlogits;
  return r;
}

PendingLoss CrossEntropyLoss::value(const Tensor& logits, const Tensor& labels) const {
  Tensor none;
  return compute(logits, labels, none);
}

PendingLoss CrossEntropyLoss::compute(const Tensor& logits, const Tensor& labels, Tensor& dlogits) {
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
  Tensor stats = Tensor::empty({ops::kLossStats}, DType::Int64, logits.device());
  ops::loss_stats(logits, labels, dlogits, 1.0f / static_cast<float>(n), stats);
  return PendingLoss(stats, labels, logits.size(1));
}

Tensor CrossEntropyLoss::backward() const {
  if (!dlogits_.defined()) {
    throw InvalidArgument("CrossEntropyLoss: backward called before forward");
  }
  return dlogits_;
}

}  // namespace mtrain::models
