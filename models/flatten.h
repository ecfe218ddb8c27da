// Flatten: [N, d1, d2, ...] -> [N, d1*d2*...] (torch.nn.Flatten with its defaults,
// start_dim=1). Forward and backward are views: no data moves.
#pragma once

#include "models/module.h"

namespace mtrain::models {

class Flatten : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Flatten"; }
  bool passes_input_grad_setting() const override { return true; }
  // A channels-last [N, H, W, C] input (Note [Channels last] in tensor/ops.h) is flattened
  // in PyTorch's (c, h, w) order, as the layers after it were trained to read it.
  void set_channels_last(bool on) { channels_last_ = on; }

 private:
  bool channels_last_ = false;
  Shape input_shape_;
  Shape output_shape_;
};

}  // namespace mtrain::models
