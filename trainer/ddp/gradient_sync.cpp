#include "trainer/ddp/gradient_sync.h"

#include <algorithm>

#include "core/error.h"

namespace mtrain {

// Note [Gradient synchronizer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With one process there is nothing to exchange, so LocalGradients only checks the hook contract
// (every parameter exactly once per backward). That keeps the path the DDP Reducer takes (the
// grad-ready hook, before/after_backward) exercised by every single-process run.
void LocalGradients::attach(models::Module& model) {
  names_.clear();
  for (const auto& p : model.parameters()) names_.push_back(p.name);
  ready_count_.assign(names_.size(), 0);
  model.set_grad_ready_hook([this](models::Parameter& p) { on_gradient_ready(p); });
  model_ = &model;
}

void LocalGradients::zero_gradients() {
  MTRAIN_CHECK(model_ != nullptr, "zero_gradients before attach");
  model_->zero_grad();
}

void LocalGradients::before_backward(const MicroBatchInfo& micro_batch) {
  if (micro_batch.sync) {
    stop_vote_ = micro_batch.stop_vote;
    compute_ = micro_batch.previous_compute;
  }
  std::fill(ready_count_.begin(), ready_count_.end(), 0);
}

void LocalGradients::on_gradient_ready(const models::Parameter& param) {
  MTRAIN_CHECK(param.index >= 0 && static_cast<size_t>(param.index) < ready_count_.size(),
               "grad-ready hook for parameter index {} of a model with {} parameters", param.index,
               ready_count_.size());
  ++ready_count_[param.index];
}

void LocalGradients::after_backward() {
  for (size_t i = 0; i < ready_count_.size(); ++i) {
    MTRAIN_CHECK(ready_count_[i] == 1,
                 "parameter {} reported its gradient ready {} times in one backward (expected once)",
                 names_[i], ready_count_[i]);
  }
}

std::string LocalGradients::describe() const {
  return fmt::format("local gradients (world of one, {} parameter tensors)", names_.size());
}

}  // namespace mtrain
