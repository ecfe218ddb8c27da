// Dynamic loss scaling for --amp fp16 (torch.cuda.amp.GradScaler's algorithm).
//
// Note [Dynamic loss scaling]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// float16 gradients below 2^-24 flush to zero. So the loss gradient is multiplied by a
// scale S before backward (every gradient is then S times too large, and the small
// ones survive the 16-bit operands of the kernels, Note [Mixed precision]), and after
// the step's gradients are final every gradient is multiplied by 1/S before the
// optimizer sees it. If any gradient element is infinite or NaN, S was too large: the
// optimizer step is skipped (parameters and momentum stay as they were), S is halved,
// and the run goes on with the next batch; after `growth_interval` steps in a row with
// finite gradients S is doubled, so it keeps tracking the largest safe value. Defaults
// are GradScaler's: S starts at 2^16, factors 2 and 0.5, interval 2000. Scaling by a
// power of two is exact in floating point, so with a power-of-two S (any the defaults
// produce) and while nothing overflows or underflows, the step equals the unscaled one
// bit for bit. The scale only multiplies backward: a loss that is not finite is a
// forward problem no scale fixes, and stops the run as diverged (Note [Agreeing to
// diverge] in train_loop.h) instead of being skipped, where GradScaler would skip and
// halve forever.
//
// In a distributed run no collective is needed to agree on skipping: the check runs on
// the all-reduced gradients, and an infinite or NaN element on any rank makes the sum
// non-finite on every rank (the reduced buckets are bitwise the same on every rank, the
// property that keeps the replicas identical and --check-replicas verifies). Every rank
// therefore holds the same S, including after a resume (checkpointer.cpp sends rank 0's
// state to all). A skipped step still counts as a step (the learning-rate
// schedule, --max-steps and checkpoints see it), as in a PyTorch loop with GradScaler.
// Gradients that are never finite are a diverged run, not an overflow: after
// kMaxConsecutiveSkips skipped steps in a row the run stops with an error (GradScaler
// would keep halving S forever).
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

// What a checkpoint records (Note [Checkpoint contents] in training_checkpoint.h).
struct LossScalerState {
  double scale = 0.0;             // 0: no scaler
  int64_t good_steps = 0;         // consecutive finite steps since the last change
  int64_t skipped_steps = 0;      // over the whole run
  int64_t consecutive_skips = 0;  // skipped in a row up to now (the divergence check)
};

class LossScaler {
 public:
  static constexpr int64_t kMaxConsecutiveSkips = 64;

  explicit LossScaler(const LossScalerOptions& options);

  // The factor for the loss gradient.
  float scale() const { return static_cast<float>(state_.scale); }
  // After the step's gradients are final: unscales `grads`, updates the scale and
  // returns true when the optimizer step must be skipped. Throws InvalidArgument
  // (diverged) after kMaxConsecutiveSkips skips in a row.
  bool unscale_and_update(const std::vector<Tensor*>& grads);

  const LossScalerState& state() const { return state_; }
  void restore(const LossScalerState& state);

 private:
  LossScalerOptions options_;
  LossScalerState state_;
};

}  // namespace mtrain
