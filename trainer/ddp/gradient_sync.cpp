#include "trainer/ddp/gradient_sync.h"

#include <algorithm>

#include "core/error.h"

namespace mtrain {

void seat_gradient(models::Parameter& p, const Tensor& flat, int64_t offset) {
  Tensor view = flat.flat_view(offset, p.grad.shape());
  view.copy_(p.grad);
  p.grad = view;
}

int64_t next_gradient_offset(int64_t offset, int64_t numel) {
  constexpr int64_t kAlign = 64 / sizeof(float);
  return offset + (numel + kAlign - 1) / kAlign * kAlign;
}

void check_seated(const models::Parameter& p, const std::string& name, const Tensor& flat) {
  MTRAIN_CHECK(p.grad.shares_storage_with(flat), "the gradient of {} is no longer a view into the flat tensor "
               "that holds the gradients", name);
}

// Note [Gradient synchronizer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With one process there is nothing to exchange, so LocalGradients only checks the hook contract
// (every parameter exactly once per backward). That keeps the path the DDP Reducer takes (the
// grad-ready hook, before/after_backward) exercised by every single-process run. Like the
// Reducer's buckets, one flat tensor holds every gradient (each parameter's is a view into
// it), so zeroing them is one fill, one launch on a GPU, where per tensor it is one each.
void LocalGradients::attach(models::Module& model) {
  names_.clear();
  const auto named = model.parameters();
  std::vector<int64_t> offsets;
  int64_t total = 0;
  bool uniform = true;  // one flat tensor needs one device and float32 throughout
  for (const auto& p : named) {
    names_.push_back(p.name);
    offsets.push_back(total);
    total = next_gradient_offset(total, p.param->grad.numel());
    uniform = uniform && p.param->grad.dtype() == DType::Float32 &&
              p.param->grad.device() == named.front().param->grad.device();
  }
  arena_ = Tensor();
  if (!named.empty() && uniform) {
    arena_ = Tensor::zeros({total}, DType::Float32, named.front().param->grad.device());
    for (size_t i = 0; i < named.size(); ++i) seat_gradient(*named[i].param, arena_, offsets[i]);
  }
  ready_count_.assign(names_.size(), 0);
  model.set_grad_ready_hook([this](models::Parameter& p) { on_gradient_ready(p); });
  model_ = &model;
}

void LocalGradients::zero_gradients() {
  MTRAIN_CHECK(model_ != nullptr, "zero_gradients before attach");
  if (!arena_.defined()) {
    model_->zero_grad();
    return;
  }
  for (const auto& p : model_->parameters()) check_seated(*p.param, p.name, arena_);
  arena_.zero_();
}

void LocalGradients::before_backward(const MicroBatchInfo& micro_batch) {
  samples_ = micro_batch.samples;
  std::fill(ready_count_.begin(), ready_count_.end(), 0);
}

void LocalGradients::skip_backward() {
  MTRAIN_CHECK(samples_ == 0, "skip_backward for a micro-batch of {} samples", samples_);
  for (int& count : ready_count_) ++count;
}

void GradientSynchronizer::backward_replayed() {
  throw InternalError(fmt::format("{}: a replayed backward, but this synchronizer cannot be captured", describe()));
}

void LocalGradients::backward_replayed() { std::fill(ready_count_.begin(), ready_count_.end(), 1); }

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
