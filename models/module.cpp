#include "models/module.h"

#include "core/error.h"

// Note [Parameter names]
// ~~~~~~~~~~~~~~~~~~~~~~
// Names are PyTorch's state_dict keys for the equivalent torch module, so weights saved by mtrain
// load into torch with load_state_dict and the other way round: a parameter's full name is the
// dotted path of child names from the root, then its own name. Children of a Sequential are named
// "0", "1", ...; composite layers name their children as the torch module's attributes do
// (Residual: conv1, conv2, conv3, bn1, bn2). Layers that torch calls functionally (the ReLUs
// inside Residual) are private members, not children, so they add no path component. Examples:
//   resnet18: "0.0.weight" (stem conv), "0.1.running_mean", "1.0.conv1.weight",
//             "2.0.conv3.weight", "7.weight";   lenet: "0.weight", "3.weight", "11.bias".
// Order = torch's named_parameters()/state_dict order: a module's own parameters in registration
// order, then each child's in child order (pre-order). That order is also the parameter index
// used by the grad-ready hook and by the optimizer state, so it must be identical on every rank
// (it is: it depends only on the architecture).
//
// Note [Grad-ready hook]
// ~~~~~~~~~~~~~~~~~~~~~~
// The DDP reducer starts an all-reduce as soon as a bucket's gradients are final, so a layer calls
// the hook for each of its parameters the moment that parameter's gradient (accumulated, see Note
// [Gradient accumulation] in tensor/ops.h) is final, before it computes its input gradient. Hooks
// therefore fire in reverse forward order: for a Sequential chain that is reverse registration
// order (bias before weight within a layer); inside a Residual block the shortcut conv (conv3,
// last in forward) fires first, then bn2, conv2, bn1, conv1, which is not reverse registration
// order, so a consumer must not assume a fixed order beyond "each parameter exactly once per
// backward". set_grad_ready_hook on the root numbers the parameters (Parameter::index = position
// in root.parameters()) and installs the hook in the whole subtree; replacing a child afterwards
// (convert_sync_batchnorm) requires installing the hook again.
//
// Note [Gradient accumulation in modules]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// zero_grad writes zeros rather than dropping the gradient tensor: the reducer may have replaced
// `grad` with a view into its bucket, and that view must stay valid and read as zero. Layers call
// the kernels with accumulate = true, except where the gradient is fresh (Parameter::grad_fresh:
// the loop marks every gradient after zeroing it, with MTRAIN_SPEEDUPS=fresh-grads): Conv2d and
// Linear then overwrite (cuDNN's and cuBLAS's beta = 0, which can pick other kernels) and clear
// the mark, so a second micro-batch adds. A writer that ignores the mark (batch norm) adds to
// zeros, which is right too; what the mark forbids is two writers of one gradient in a backward
// of which only the second honours it, and no model here shares a parameter between layers.
//
// Note [Saved tensors die with backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What a layer's forward keeps for its backward (its input, its output, argmax indices) is
// released as soon as that backward is done, as PyTorch's autograd frees saved tensors. Backward
// runs from the last layer to the first, so the memory of the later layers' activations is back in
// the allocator's cache by the time the earlier layers allocate their input gradients, and the
// step's peak is the activations plus a few gradients rather than both in full. A second backward
// for one forward is an error (like backward without retain_graph). Each layer's backward does the
// releasing.

namespace mtrain::models {

namespace {
std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}
}  // namespace

void Module::to(Device device) {
  std::vector<NamedParameter> params = parameters();
  std::vector<NamedBuffer> buffers_in_tree = buffers();
  // Every copy is made before any is installed, so a failure (no such device, out of
  // memory) leaves the whole model where it was rather than split across two devices.
  std::vector<Tensor> moved;
  moved.reserve(2 * params.size() + buffers_in_tree.size());
  auto move = [&](const Tensor& t) { moved.push_back(t.defined() ? t.to(device) : t); };
  for (const NamedParameter& p : params) {
    move(p.param->value);
    move(p.param->grad);
  }
  for (const NamedBuffer& b : buffers_in_tree) move(*b.buffer);
  size_t next = 0;
  for (NamedParameter& p : params) {
    p.param->value = std::move(moved[next++]);
    p.param->grad = std::move(moved[next++]);
  }
  for (NamedBuffer& b : buffers_in_tree) *b.buffer = std::move(moved[next++]);
}

void Module::train(bool on) {
  training_ = on;
  for (Child& c : children_) c.module->train(on);
}

std::vector<NamedParameter> Module::parameters() {
  std::vector<NamedParameter> out;
  collect_parameters("", out);
  return out;
}

std::vector<NamedBuffer> Module::buffers() {
  std::vector<NamedBuffer> out;
  collect_buffers("", out);
  return out;
}

int64_t Module::num_parameter_elements() {
  int64_t n = 0;
  for (const NamedParameter& p : parameters()) n += p.param->value.numel();
  return n;
}

void Module::zero_grad() {
  for (auto& [name, p] : params_) p->grad.zero_();
  for (Child& c : children_) c.module->zero_grad();
}

void Module::set_grad_ready_hook(GradReadyHook hook) {
  int index = 0;
  for (NamedParameter& p : parameters()) p.param->index = index++;
  install_hook(hook ? std::make_shared<GradReadyHook>(std::move(hook)) : nullptr);
}

const std::string& Module::child_name(size_t i) const {
  MTRAIN_CHECK(i < children_.size(), "{} has {} children, asked for child {}", type_name(),
               children_.size(), i);
  return children_[i].name;
}

Module& Module::child(size_t i) const {
  MTRAIN_CHECK(i < children_.size(), "{} has {} children, asked for child {}", type_name(),
               children_.size(), i);
  return *children_[i].module;
}

std::unique_ptr<Module> Module::replace_child(size_t i, std::unique_ptr<Module> replacement) {
  MTRAIN_CHECK(i < children_.size(), "{} has {} children, asked to replace child {}",
               type_name(), children_.size(), i);
  MTRAIN_CHECK(replacement != nullptr, "replacing child '{}' of {} with nothing",
               children_[i].name, type_name());
  replacement->train(training_);
  std::swap(children_[i].module, replacement);
  return replacement;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out;
  collect_modules("", out);
  return out;
}

void Module::register_parameter(std::string name, Parameter& param, const Shape& shape) {
  param.value = Tensor::zeros(shape);
  param.grad = Tensor::zeros(shape);
  params_.emplace_back(std::move(name), &param);
}

void Module::register_buffer(std::string name, Tensor& buffer) {
  buffers_.emplace_back(std::move(name), &buffer);
}

size_t Module::register_module(std::string name, std::unique_ptr<Module> child) {
  MTRAIN_CHECK(child != nullptr, "{}: registering an empty child '{}'", type_name(), name);
  child->train(training_);
  children_.push_back({std::move(name), std::move(child)});
  return children_.size() - 1;
}

void Module::notify_grad_ready(Parameter& param) {
  if (grad_ready_hook_ && *grad_ready_hook_) (*grad_ready_hook_)(param);
}

void Module::collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out) {
  for (auto& [name, p] : params_) out.push_back({join_name(prefix, name), p});
  for (Child& c : children_) c.module->collect_parameters(join_name(prefix, c.name), out);
}

void Module::collect_buffers(const std::string& prefix, std::vector<NamedBuffer>& out) {
  for (auto& [name, b] : buffers_) out.push_back({join_name(prefix, name), b});
  for (Child& c : children_) c.module->collect_buffers(join_name(prefix, c.name), out);
}

void Module::collect_modules(const std::string& prefix,
                             std::vector<std::pair<std::string, Module*>>& out) {
  out.emplace_back(prefix, this);
  for (Child& c : children_) c.module->collect_modules(join_name(prefix, c.name), out);
}

void Module::install_hook(const std::shared_ptr<GradReadyHook>& hook) {
  grad_ready_hook_ = hook;
  for (Child& c : children_) c.module->install_hook(hook);
}

void mark_gradients_fresh(Module& root) {
  for (const NamedParameter& p : root.parameters()) p.param->grad_fresh = true;
}

bool take_fresh(Parameter& p) {
  const bool fresh = p.grad_fresh;
  p.grad_fresh = false;
  return fresh;
}

int replace_modules(Module& root, const ModuleReplacer& replacer) {
  int replaced = 0;
  for (size_t i = 0; i < root.num_children(); ++i) {
    std::unique_ptr<Module> replacement = replacer(root.child(i));
    if (replacement) {
      root.replace_child(i, std::move(replacement));
      ++replaced;
    } else {
      replaced += replace_modules(root.child(i), replacer);
    }
  }
  return replaced;
}

}  // namespace mtrain::models
