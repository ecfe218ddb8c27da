// Evaluation over a whole dataset in eval mode (BatchNorm uses its running statistics).
// Returns sums and counts rather than means so a distributed run can all-reduce them
// (sum of correct, sum of count) before dividing.
#pragma once

#include <cstdint>
#include <functional>

#include "data/dataloader.h"
#include "models/module.h"

namespace mtrain {

struct EvalResult {
  double loss_sum = 0.0;  // sum of per-image cross-entropy
  int64_t correct = 0;
  int64_t count = 0;

  double mean_loss() const { return count > 0 ? loss_sum / static_cast<double>(count) : 0.0; }
  double accuracy() const { return count > 0 ? static_cast<double>(correct) / static_cast<double>(count) : 0.0; }
};

// Runs `model` over every batch of one epoch of `loader` (its epoch 0: evaluation
// samplers do not shuffle) in eval mode, then restores the model's previous mode. The
// batches go to `device`, where the model lives (Note [Batches to the device] in
// device_batches.cpp); the sums come back to the host. Errors of the model and the loader pass
// through.
// `on_batch(done, batches)` is called once each batch's figures are read, one batch behind its
// forward (progress reports).
EvalResult evaluate(models::Module& model, data::DataLoader& loader, Device device = Device::cpu(),
                    const std::function<void(int64_t done, int64_t batches)>& on_batch = {});

}  // namespace mtrain
