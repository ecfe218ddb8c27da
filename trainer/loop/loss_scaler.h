// Dynamic loss scaling for --amp fp16 (torch.cuda.amp.GradScaler's algorithm; Note [Dynamic loss
// scaling] in loss_scaler.cpp): the loop multiplies the loss gradient by scale(), and after the
// step's gradients are final unscale_and_update() divides them by it and says whether the step
// must be skipped. Called on the all-reduced gradients, it decides the same on every rank. Not
// thread-safe; one per run.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace mtrain {

struct LossScalerOptions {
  double initial_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

// What a checkpoint records (Note [Checkpoint contents] in checkpoint_file.cpp).
struct LossScalerState {
  double scale = 0.0;             // 0: no scaler
  int64_t good_steps = 0;         // consecutive finite steps since the last change
  int64_t skipped_steps = 0;      // over the whole run
  int64_t consecutive_skips = 0;  // skipped in a row up to now (the divergence check)
};

class LossScaler {
 public:
  static constexpr int64_t kMaxConsecutiveSkips = 64;

  // Throws InvalidArgument unless the initial scale is a normal float32 whose reciprocal is one
  // too, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1.
  explicit LossScaler(const LossScalerOptions& options);

  // The factor for the loss gradient.
  float scale() const { return static_cast<float>(state_.scale); }
  // After the step's gradients are final: unscales `grads`, updates the scale and
  // returns true when the optimizer step must be skipped. Throws InvalidArgument
  // (diverged) after kMaxConsecutiveSkips skips in a row.
  bool unscale_and_update(const std::vector<Tensor*>& grads);

  const LossScalerState& state() const { return state_; }
  // Adopts a checkpoint's state; InvalidArgument when it is not one a scaler can be in.
  void restore(const LossScalerState& state);

 private:
  LossScalerOptions options_;
  LossScalerState state_;
};

}  // namespace mtrain
