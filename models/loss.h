// CrossEntropyLoss: softmax cross-entropy averaged over the batch
// (torch.nn.CrossEntropyLoss(reduction='mean') on logits and class indices), which also
// counts correct predictions so training and evaluation get accuracy for free.
// Not a Module: it takes labels and ends the backward chain.
#pragma once

#include <cstdint>

#include "tensor/host_copy.h"
#include "tensor/tensor.h"

namespace mtrain::models {

struct LossResult {
  double loss = 0.0;    // mean over the batch
  int64_t correct = 0;  // rows whose argmax equals the label
  int64_t count = 0;    // batch size
};

// One batch's figures, computed on the logits' device and on their way to the host (Note
// [Loss statistics stay on the device] in loss.cpp).
class PendingLoss {
 public:
  // Waits for the loss's own kernels, not for work queued after them. Throws
  // InvalidArgument when a label lies outside [0, K), naming the first such sample
  // (fetching that label waits for the whole stream).
  LossResult read() const;

 private:
  friend class CrossEntropyLoss;
  PendingLoss(const Tensor& stats, const Tensor& labels, int64_t classes);

  HostCopy stats_;
  Tensor labels_;  // for the message about a bad label
  int64_t classes_ = 0;
};

class CrossEntropyLoss {
 public:
  // logits float32 [N, K], labels int64 [N] in [0, K), N >= 1, both on one device.
  // Keeps d(loss)/d(logits), on that device, for backward.
  PendingLoss forward(const Tensor& logits, const Tensor& labels);
  // The same figures without computing d(loss)/d(logits), for evaluation; backward()
  // then still refers to the last forward().
  PendingLoss value(const Tensor& logits, const Tensor& labels) const;
  // d(mean loss)/d(logits) of the last forward. Its values are unspecified when a label
  // was outside [0, K), which reading that forward's figures reports.
  Tensor backward() const;

 private:
  // `dlogits` may be undefined (no gradient).
  static PendingLoss compute(const Tensor& logits, const Tensor& labels, Tensor& dlogits);

  Tensor dlogits_;
};

}  // namespace mtrain::models
