// Input validation shared by the layers: a wrong input shape is a user error (a model
// fed the wrong data), so it is an InvalidArgument naming the layer, what it expected
// and what it got.
#pragma once

#include <cstdint>
#include <string>

#include "tensor/tensor.h"

namespace mtrain::models::detail {

// "Floating" below: float32, or bfloat16 / float16 activations (Note [16-bit activations]
// in tensor/ops.h; models/mixed_precision.h says which layers pass them on).

// x must be defined and floating.
void check_floating(const std::string& layer, const Tensor& x);
// x must be floating [N, channels, H, W] (channels < 0: any).
void check_image_batch(const std::string& layer, const Tensor& x, int64_t channels);
// x must be floating [N, H, W, channels]: an image batch channels last (Note [Channels last]
// in tensor/ops.h).
void check_image_batch_channels_last(const std::string& layer, const Tensor& x, int64_t channels);
// x must be floating [N, features].
void check_matrix_batch(const std::string& layer, const Tensor& x, int64_t features);
// dy must be floating with the shape of the output of the last forward (and that forward
// happened).
void check_output_grad(const std::string& layer, const Tensor& dy, const Shape& output_shape);

// The input of a layer with parameters must be on their device: a model that was not
// moved with model.to(...) is the most common mistake, so the message names both
// devices and the fix.
void check_input_device(const std::string& layer, const Tensor& x, const Tensor& parameter);
// dy must be on the device of the forward that it is the gradient of.
void check_output_grad_device(const std::string& layer, const Tensor& dy, Device forward_device);

}  // namespace mtrain::models::detail
