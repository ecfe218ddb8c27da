// Sequential: children named "0", "1", ... run in order; backward runs them in
// reverse (torch.nn.Sequential).
#pragma once

#include <memory>
#include <utility>

#include "models/module.h"

namespace mtrain::models {

class Sequential : public Module {
 public:
  Sequential() = default;

  // Appends `layer` under the next index name and returns *this for chaining.
  Sequential& append(std::unique_ptr<Module> layer);
  // Appends `layer` under `name` (torch's Sequential of an OrderedDict; torchvision's
  // ResNet is such a chain: conv1, bn1, relu, ..., fc).
  Sequential& append(const std::string& name, std::unique_ptr<Module> layer);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  void set_input_grad_needed(bool needed) override;
  std::string type_name() const override { return "Sequential"; }
};

// make_sequential(std::make_unique<Conv2d>(...), std::make_unique<ReLU>(), ...)
template <class... Layers>
std::unique_ptr<Sequential> make_sequential(std::unique_ptr<Layers>... layers) {
  auto seq = std::make_unique<Sequential>();
  (seq->append(std::move(layers)), ...);
  return seq;
}

}  // namespace mtrain::models
