// SGD with momentum, dampening, weight decay and Nesterov, as torch.optim.SGD
// (see ops::sgd_step for the update). Holds the model's parameters in their
// registration order (Note [Parameter names]), so momentum buffer i belongs to
// parameter i, as in torch's optimizer state_dict. It keeps pointers to the model's
// parameters: build it after any replace_modules (convert_sync_batchnorm).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/module.h"

namespace mtrain::models {

struct SgdOptions {
  float lr = 0.1f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

class Sgd {
 public:
  // Validates as torch does: lr, momentum, weight_decay >= 0; Nesterov needs
  // momentum > 0 and dampening 0. Throws InvalidArgument otherwise.
  Sgd(Module& model, const SgdOptions& options);

  // One update of every parameter from its current gradient: one fused ops::sgd_step_all
  // over the model, on the parameters' device (momentum buffers are allocated there).
  void step();
  // Zeroes every parameter's gradient (Module::zero_grad on the model).
  void zero_grad();

  float lr() const { return options_.lr; }
  void set_lr(float lr);  // learning-rate schedules; lr >= 0
  const SgdOptions& options() const { return options_; }
  int64_t steps_taken() const { return steps_taken_; }

  // Momentum buffer per parameter, undefined until that parameter's first step (as
  // torch's state before the first step). A checkpoint saves and restores these.
  std::vector<Tensor>& momentum_buffers() { return momentum_buffers_; }

 private:
  // InvalidArgument unless every parameter and momentum buffer is on one device.
  void check_devices() const;

  Module& model_;
  SgdOptions options_;
  std::vector<Parameter*> params_;
  std::vector<std::string> param_names_;  // for error messages
  std::vector<Tensor> momentum_buffers_;
  int64_t steps_taken_ = 0;
};

}  // namespace mtrain::models
