// Dropout: torch.nn.Dropout(p). In training mode each forward zeroes every element with
// probability p and scales the others by 1 / (1 - p); backward applies the same mask. In eval
// mode, or with p = 0, it passes its input through. Masks come from ops::dropout_mask, seeded
// by the layer's seed and a count of its training forwards: the same on every device and, for
// the same seed, on every rank (as PyTorch's generator seeded alike on every rank); a resumed
// run starts the count again.
#pragma once

#include <cstdint>

#include "models/module.h"

namespace mtrain::models {

class Dropout : public Module {
 public:
  // InvalidArgument unless 0 <= p < 1.
  Dropout(float p, uint64_t seed);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Dropout"; }
  // Each training forward draws a new mask.
  bool replayable() const override { return p_ == 0.0f; }

 private:
  float p_;
  uint64_t seed_;
  uint64_t draws_ = 0;
  Tensor mask_;  // the last training forward's; undefined when it passed its input through
};

}  // namespace mtrain::models
