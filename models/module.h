// Module: the base of every layer and model. A module owns its parameters, buffers and child
// modules, runs `forward`, and runs an explicit `backward` (Caffe / llm.c style): each layer caches
// in forward what its backward needs, so one forward must precede each backward and a second
// forward overwrites the cache. Layers may keep their input or output tensors (handles share
// data, Note [Tensor semantics]): callers must not modify a forward's input or output in place
// before the matching backward. Parameter names and order are torch's state_dict's (Note
// [Parameter names] in module.cpp). Not thread-safe: one thread drives a module tree.
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
  int index = -1;  // position in the hooked root's parameters(), see Note [Grad-ready hook] (module.cpp)
  // grad holds zeros that nothing has added to yet: its next writer may overwrite it
  // instead of adding (Note [Gradient accumulation in modules] in module.cpp).
  bool grad_fresh = false;
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

// What a layer's forward keeps for its backward is released when that backward is done, and a
// second backward for one forward is an error (Note [Saved tensors die with backward] in
// module.cpp).
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
  // False for a layer whose training forward and backward a CUDA graph cannot replay: one
  // that decides on the host, call by call, what its kernels compute (Dropout's draws) or
  // that waits for other ranks on the host (SyncBatchNorm). A replay repeats the captured
  // call exactly (Note [Captured steps] in tensor/cuda_graph.h). This layer's own work
  // only: containers are asked through their children.
  virtual bool replayable() const { return true; }

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
  // empty function removes the hook. The hook runs on the backward's thread, once per
  // parameter per backward, the moment its gradient is final, in no fixed order (Note
  // [Grad-ready hook]). Replacing a child afterwards requires installing the hook again.
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

// Marks every gradient of the subtree fresh (Parameter::grad_fresh): call right after
// zeroing them, when their writers should overwrite rather than add.
void mark_gradients_fresh(Module& root);

// Whether a layer writing p's gradient may overwrite it, and from now on it may not:
// the layer's `accumulate` is the negation.
bool take_fresh(Parameter& p);

// Walks the subtree below `root` in pre-order and calls `replacer` on every module
// except the root; a non-null result takes that module's place in its parent (and is
// not descended into). Returns how many modules were replaced. This is how
// convert_sync_batchnorm swaps every BatchNorm2d for a SyncBatchNorm.
int replace_modules(Module& root, const ModuleReplacer& replacer);

}  // namespace mtrain::models
