#include "models/input_checks.h"

#include "core/error.h"

namespace mtrain::models::detail {

void check_floating(const std::string& layer, const Tensor& x) {
  if (!x.defined()) throw InvalidArgument(fmt::format("{}: input is an undefined tensor", layer));
  if (!is_floating(x.dtype())) {
    throw InvalidArgument(fmt::format("{}: expected a float32 input, found {}", layer, x.str()));
  }
}

void check_image_batch(const std::string& layer, const Tensor& x, int64_t channels) {
  check_floating(layer, x);
  if (x.ndim() != 4 || (channels >= 0 && x.size(1) != channels)) {
    const std::string c = channels >= 0 ? std::to_string(channels) : "C";
    throw InvalidArgument(fmt::format("{}: expected input [N, {}, H, W], found {}", layer, c,
                                      shape_str(x.shape())));
  }
}

void check_image_batch_channels_last(const std::string& layer, const Tensor& x, int64_t channels) {
  check_floating(layer, x);
  if (x.ndim() != 4 || (channels >= 0 && x.size(3) != channels)) {
    const std::string c = channels >= 0 ? std::to_string(channels) : "C";
    throw InvalidArgument(fmt::format("{}: expected a channels-last input [N, H, W, {}], found {}", layer, c,
                                      shape_str(x.shape())));
  }
}

void check_matrix_batch(const std::string& layer, const Tensor& x, int64_t features) {
  check_floating(layer, x);
  if (x.ndim() != 2 || x.size(1) != features) {
    throw InvalidArgument(fmt::format("{}: expected input [N, {}], found {}", layer, features,
                                      shape_str(x.shape())));
  }
}

void check_output_grad(const std::string& layer, const Tensor& dy, const Shape& output_shape) {
  if (output_shape.empty()) {
    throw InvalidArgument(fmt::format(
        "{}: backward called before forward (or twice after one forward: the first backward releases what "
        "forward saved)",
        layer));
  }
  if (!dy.defined() || !is_floating(dy.dtype()) || dy.shape() != output_shape) {
    throw InvalidArgument(fmt::format("{}: expected an output gradient float32 {}, found {}",
                                      layer, shape_str(output_shape),
                                      dy.defined() ? dy.str() : "an undefined tensor"));
  }
}

void check_input_device(const std::string& layer, const Tensor& x, const Tensor& parameter) {
  if (x.device() == parameter.device()) return;
  throw InvalidArgument(fmt::format(
      "{}: the input is on {} but the layer's parameters are on {}; move the model to the "
      "input's device with model.to({}) (or the input with .to({})) before the forward",
      layer, x.device().str(), parameter.device().str(), x.device().str(),
      parameter.device().str()));
}

void check_output_grad_device(const std::string& layer, const Tensor& dy, Device forward_device) {
  if (dy.device() == forward_device) return;
  throw InvalidArgument(fmt::format(
      "{}: expected the output gradient on {}, where the forward ran, found it on {}", layer,
      forward_device.str(), dy.device().str()));
}

}  // namespace mtrain::models::detail
