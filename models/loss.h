// CrossEntropyLoss: softmax cross-entropy averaged over the batch
// (torch.nn.CrossEntropyLoss(reduction='mean') on logits and class indices), which also
// counts correct predictions so training and evaluation get accuracy for free.
// Not a Module: it takes labels and ends the backward chain.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace mtrain::models {

struct LossResult {
  double loss = 0.0;    // mean over the batch
  int64_t correct = 0;  // rows whose argmax equals the label
  int64_t count = 0;    // batch size
};

class CrossEntropyLoss {
 public:
  // logits float32 [N, K], labels int64 [N] in [0, K), N >= 1, both on one device.
  // Keeps d(loss)/d(logits), on that device, for backward.
  LossResult forward(const Tensor& logits, const Tensor& labels);
  // The same figures without computing d(loss)/d(logits), for evaluation; backward()
  // then still refers to the last forward().
  LossResult value(const Tensor& logits, const Tensor& labels) const;
  // d(mean loss)/d(logits) of the last forward.
  Tensor backward() const;

 private:
  // `dlogits` may be undefined (no gradient).
  static LossResult compute(const Tensor& logits, const Tensor& labels, Tensor& dlogits);

  Tensor dlogits_;
};

}  // namespace mtrain::models
