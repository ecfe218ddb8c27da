#include "models/sequential.h"

#include <string>

namespace mtrain::models {

Sequential& Sequential::append(std::unique_ptr<Module> layer) {
  register_module(std::to_string(num_children()), std::move(layer));
  return *this;
}

Sequential& Sequential::append(const std::string& name, std::unique_ptr<Module> layer) {
  register_module(name, std::move(layer));
  return *this;
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (size_t i = 0; i < num_children(); ++i) h = child(i).forward(h);
  return h;
}

void Sequential::set_input_grad_needed(bool needed) {
  Module::set_input_grad_needed(needed);
  for (size_t i = 0; i < num_children(); ++i) {
    child(i).set_input_grad_needed(needed);
    if (!child(i).passes_input_grad_setting()) break;
  }
}

Tensor Sequential::backward(const Tensor& dy) {
  Tensor d = dy;
  for (size_t i = num_children(); i-- > 0;) d = child(i).backward(d);
  return d;
}

}  // namespace mtrain::models
