#include "trainer/loop/evaluate.h"

#include <optional>

#include "models/loss.h"
#include "trainer/loop/device_batches.h"

namespace mtrain {

namespace {

// Puts a module in eval mode for one scope, restoring its mode even on an exception.
class EvalModeGuard {
 public:
  explicit EvalModeGuard(models::Module& model) : model_(model), was_training_(model.is_training()) {
    model_.eval();
  }
  ~EvalModeGuard() { model_.train(was_training_); }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  models::Module& model_;
  bool was_training_;
};

}  // namespace

EvalResult evaluate(models::Module& model, data::DataLoader& loader, Device device,
                    const std::function<void(int64_t done, int64_t batches)>& on_batch) {
  EvalModeGuard guard(model);
  models::CrossEntropyLoss loss;
  EvalResult result;
  DeviceBatches batches(loader, device);
  batches.start_epoch(0);
  const int64_t total = loader.num_batches();
  int64_t done = 0;
  const auto add = [&](const models::PendingLoss& pending) {
    const models::LossResult r = pending.read();
    result.loss_sum += r.loss * static_cast<double>(r.count);
    result.correct += r.correct;
    result.count += r.count;
    if (on_batch) on_batch(++done, total);
  };
  // Each batch's figures are read once the next batch's forward is queued, so that a GPU
  // never waits for the host between batches (Note [Loss statistics stay on the device]
  // in models/loss.cpp).
  std::optional<models::PendingLoss> previous;
  while (auto batch = batches.next()) {
    const Tensor logits = model.forward(batch->images);
    models::PendingLoss current = loss.value(logits, batch->labels);  // no gradient to compute
    if (previous) add(*previous);
    previous = std::move(current);
  }
  if (previous) add(*previous);
  return result;
}

}  // namespace mtrain
