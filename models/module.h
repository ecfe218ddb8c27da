// Module: the base of every layer and model. A module owns its parameters, buffers and
// child modules, runs `forward`, and runs an explicit `backward` (Caffe / llm.c style):
// each layer caches in forward what its backward needs, so one forward must precede
// each backward and a second forward overwrites the cache. Layers may keep their input
// or output tensors (handles share data, Note [Tensor semantics]): callers must not
// modify a forward's input or output in place before the matching backward.
//
// Note [Parameter names]
// ~~~~~~~~~~~~~~~~~~~~~~
// Names are PyTorch's state_dict keys for the equivalent torch module, so weights
// saved by mtrain load into torch with load_state_dict and the other way round:
// a parameter's full name is the dotted path of child names from the root, then its
// own name. Children of a Sequential are named "0", "1", ...; composite layers name
// their children as the torch module's attributes do (Residual: conv1, conv2, conv3,
// bn1, bn2). Layers that torch calls functionally (the ReLUs inside Residual) are
// private members, not children, so they add no path component. Examples:
//   resnet18: "0.0.weight" (stem conv), "0.1.running_mean", "1.0.conv1.weight",
//             "2.0.conv3.weight", "7.weight";   lenet: "0.weight", "3.weight", "11.bias".
// Order = torch's named_parameters()/state_dict order: a module's own parameters in
// registration order, then each child's in child order (pre-order). That order is
// also the parameter index used by the grad-ready hook and by the optimizer state,
// so it must be identical on every rank (it is: it depends only on the architecture).
//
// Note [Grad-ready hook]
// ~~~~~~~~~~~~~~~~~~~~~~
// The DDP reducer starts an all-reduce as soon as a bucket's gradients are final, so a
// layer calls the hook for each of its parameters the moment that parameter's gradient
// (accumulated, see Note [Gradient accumulation] in tensor/ops.h) is final, before it
// computes its input gradient. Hooks therefore fire in reverse forward order: for a
// Sequential chain that is reverse registration order (bias before weight within a
// layer); inside a Residual block the shortcut conv (conv3, last in forward) fires
// first, then bn2, conv2, bn1, conv1, which is not reverse registration order, so a
// consumer must not assume a fixed order beyond "each parameter exactly once per
// backward". set_grad_ready_hook on the root numbers the parameters (Parameter::index =
// position in root.parameters()) and installs the hook in the whole subtree; replacing
// a child afterwards (convert_sync_batchnorm) requires installing the hook again.
//
// Note [Gradient accumulation in modules]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Layers always call the kernels with accumulate = true, and zero_grad writes zeros
// rather than dropping the gradient tensor: the reducer may have replaced `grad` with a
// view into its bucket, and that view must stay valid and read as zero. Overwriting on
// the first backward after zero_grad would save one read per gradient element, which
// is not worth a flag that every writer of `grad` would have to honour.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace mtrain::models {

struct Parameter {
  Tensor value;
  Tensor grad;     // same shape as value; accumulates until zero_grad
  int index = -1;  // position in the hooked root's parameters(), see Note [Grad-ready hook]
};

struct NamedParameter {
  std::string name;  // full dotted name, see Note [Parameter names]
  Parameter* param;
};

struct NamedBuffer {
  std::string name;
  Tensor* buffer;  // writable: rank 0's buffers are broadcast into it
};

using GradReadyHook = std::function<void(Parameter& param)>;

class Module;
class ParameterInitializer;  // models/init.h
// Given a module, returns its replacement or nullptr to keep it (see replace_modules).
using ModuleReplacer = std::function<std::unique_ptr<Module>(Module& module)>;

// Note [Saved tensors die with backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What a layer's forward keeps for its backward (its input, its output, argmax
// indices) is released as soon as that backward is done, as PyTorch's autograd frees
// saved tensors. Backward runs from the last layer to the first, so the memory of the
// later layers' activations is back in the allocator's cache by the time the earlier
// layers allocate their input gradients, and the step's peak is the activations plus
// a few gradients rather than both in full. A second backward for one forward is an
// error (like backward without retain_graph).
class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  // Parameters and children are registered by address: a module never moves.
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  virtual Tensor forward(const Tensor& x) = 0;
  // Takes dL/d(output of the last forward), accumulates parameter gradients, fires the
  // grad-ready hook per parameter and returns dL/d(input). Once per forward: see
  // Note [Saved tensors die with backward].
  virtual Tensor backward(const Tensor& dy) = 0;
  // The torch class name ("Conv2d"), used in error messages.
  virtual std::string type_name() const = 0;
  // Fills this module's own parameters (not its children's) and resets its buffers.
  // Layers without parameters keep the default. Called by init_parameters (init.h).
  virtual void reset_parameters(ParameterInitializer& init) {}

  void train(bool on = true);  // recursive
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Whether backward must return dL/d(input) (default: yes). The trainer turns it off
  // at the model's root because nothing uses the gradient of the images (as a torch
  // input has requires_grad=False): containers pass the setting to the child that sees
  // their input, and Conv2d and Linear then skip their input-gradient kernel and return
  // an undefined tensor. For LeNet that is the costliest kernel of the step.
  virtual void set_input_grad_needed(bool needed) { input_grad_needed_ = needed; }
  bool input_grad_needed() const { return input_grad_needed_; }
  // True for a layer without parameters whose backward, when its input gradient is not
  // needed, returns an undefined tensor without reading dy (Flatten): a container then
  // passes the setting on to the layer after it, so that one skips its input-gradient
  // kernel too (mlp's first Linear, 784 inputs wide).
  virtual bool passes_input_grad_setting() const { return false; }

  // Moves every parameter (value and grad) and buffer of the subtree to `device`, as
  // torch's Module.to: later forwards expect inputs there, and every layer allocates
  // its outputs and saved tensors on its input's device. Call it before anything holds
  // views of the gradients or optimizer state (the reducer's buckets, momentum), which
  // would otherwise keep pointing at the old copies; a no-op when already there.
  void to(Device device);

  std::vector<NamedParameter> parameters();  // whole subtree, Note [Parameter names] order
  std::vector<NamedBuffer> buffers();
  int64_t num_parameter_elements();
  void zero_grad();  // recursive, see Note [Gradient accumulation in modules]

  // Numbers the subtree's parameters and installs `hook` in every module of it; an
  // empty function removes the hook. See Note [Grad-ready hook].
  void set_grad_ready_hook(GradReadyHook hook);

  // Children, in registration order.
  size_t num_children() const { return children_.size(); }
  const std::string& child_name(size_t i) const;
  Module& child(size_t i) const;
  // Puts `replacement` in slot i (same name) and returns the module it replaces.
  std::unique_ptr<Module> replace_child(size_t i, std::unique_ptr<Module> replacement);
  // Every module of the subtree with its dotted path ("" for this one), pre-order.
  std::vector<std::pair<std::string, Module*>> named_modules();

 protected:
  // `param` must be a member of the derived layer (stable address); grad is allocated.
  void register_parameter(std::string name, Parameter& param, const Shape& shape);
  void register_buffer(std::string name, Tensor& buffer);
  // Returns the slot index of the new child.
  size_t register_module(std::string name, std::unique_ptr<Module> child);
  // Layers call this once per parameter per backward, when its gradient is final.
  void notify_grad_ready(Parameter& param);

 private:
  void collect_parameters(const std::string& prefix, std::vector<NamedParameter>& out);
  void collect_buffers(const std::string& prefix, std::vector<NamedBuffer>& out);
  void collect_modules(const std::string& prefix,
                       std::vector<std::pair<std::string, Module*>>& out);
  void install_hook(const std::shared_ptr<GradReadyHook>& hook);

  struct Child {
    std::string name;
    std::unique_ptr<Module> module;
  };
  bool training_ = true;
  bool input_grad_needed_ = true;
  std::vector<std::pair<std::string, Parameter*>> params_;
  std::vector<std::pair<std::string, Tensor*>> buffers_;
  std::vector<Child> children_;
  std::shared_ptr<GradReadyHook> grad_ready_hook_;
};

// Walks the subtree below `root` in pre-order and calls `replacer` on every module
// except the root; a non-null result takes that module's place in its parent (and is
// not descended into). Returns how many modules were replaced. This is how
// convert_sync_batchnorm swaps every BatchNorm2d for a SyncBatchNorm.
int replace_modules(Module& root, const ModuleReplacer& replacer);

}  // namespace mtrain::models
