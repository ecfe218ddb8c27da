#include "models/optim.h"

#include "core/error.h"
#include "tensor/ops.h"

namespace mtrain::models {

namespace {
void check_lr(float lr) {
  if (!(lr >= 0.0f)) throw InvalidArgument(fmt::format("SGD: expected lr >= 0, found {}", lr));
}
}  // namespace

Sgd::Sgd(Module& model, const SgdOptions& options) : model_(model), options_(options) {
  check_lr(options.lr);
  if (!(options.momentum >= 0.0f) || !(options.weight_decay >= 0.0f)) {
    throw InvalidArgument(fmt::format(
        "SGD: expected momentum >= 0 and weight_decay >= 0, found momentum={} weight_decay={}",
        options.momentum, options.weight_decay));
  }
  if (options.nesterov && (options.momentum <= 0.0f || options.dampening != 0.0f)) {
    throw InvalidArgument(fmt::format(
        "SGD: Nesterov momentum requires momentum > 0 and dampening 0, found momentum={} "
        "dampening={}",
        options.momentum, options.dampening));
  }
  for (const NamedParameter& p : model.parameters()) params_.push_back(p.param);
  momentum_buffers_.resize(params_.size());
}

void Sgd::set_lr(float lr) {
  check_lr(lr);
  options_.lr = lr;
}

void Sgd::step() {
  const bool uses_momentum = options_.momentum != 0.0f;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    Tensor& buf = momentum_buffers_[i];
    const bool first_step = uses_momentum && !buf.defined();
    if (first_step) buf = Tensor::empty(p.value.shape());
    ops::sgd_step(p.value, p.grad, buf, options_.lr, options_.momentum, options_.dampening,
                  options_.weight_decay, options_.nesterov, first_step);
  }
  ++steps_taken_;
}

void Sgd::zero_grad() { model_.zero_grad(); }

}  // namespace mtrain::models
