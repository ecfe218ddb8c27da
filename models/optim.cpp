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
  for (const NamedParameter& p : model.parameters()) {
    params_.push_back(p.param);
    param_names_.push_back(p.name);
  }
  momentum_buffers_.resize(params_.size());
}

void Sgd::set_lr(float lr) {
  check_lr(lr);
  options_.lr = lr;
}

void Sgd::step() {
  MTRAIN_CHECK(momentum_buffers_.size() == params_.size(),
               "SGD holds {} momentum buffers for {} parameters", momentum_buffers_.size(),
               params_.size());
  check_devices();
  // A parameter whose buffer does not exist yet takes its first momentum step (the
  // buffer starts as the gradient). The buffers appear together, so this is one group
  // unless someone restored only some of them through momentum_buffers().
  const bool uses_momentum = options_.momentum != 0.0f;
  std::vector<ops::SgdParamRef> first, later;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    Tensor& buf = momentum_buffers_[i];
    const bool first_step = uses_momentum && !buf.defined();
    if (first_step) buf = Tensor::empty(p.value.shape(), p.value.dtype(), p.value.device());
    (first_step ? first : later).push_back({&p.value, &p.grad, &buf});
  }
  for (const bool first_step : {true, false}) {
    const std::vector<ops::SgdParamRef>& group = first_step ? first : later;
    if (group.empty()) continue;
    ops::sgd_step_all(group, options_.lr, options_.momentum, options_.dampening,
                      options_.weight_decay, options_.nesterov, first_step);
  }
  ++steps_taken_;
}

void Sgd::check_devices() const {
  if (params_.empty()) return;
  // The fused update runs on one device. A model split across devices (to() on a part
  // of it) or moved after the first step (momentum left behind) would otherwise reach
  // the kernel as an internal error.
  const Device device = params_[0]->value.device();
  for (size_t i = 0; i < params_.size(); ++i) {
    const Device here = params_[i]->value.device();
    if (here != device) {
      throw InvalidArgument(fmt::format(
          "SGD: parameter '{}' is on {} but '{}' is on {}; move the whole model with "
          "model.to(device)",
          param_names_[i], here.str(), param_names_[0], device.str()));
    }
    const Tensor& buf = momentum_buffers_[i];
    if (buf.defined() && buf.device() != device) {
      throw InvalidArgument(fmt::format(
          "SGD: the momentum buffer of '{}' is on {} but the parameter is on {}: the model "
          "was moved after the optimizer's first step; move it with model.to(device) before "
          "training starts",
          param_names_[i], buf.device().str(), device.str()));
    }
  }
}

void Sgd::zero_grad() { model_.zero_grad(); }

}  // namespace mtrain::models
