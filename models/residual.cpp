#include "models/residual.h"

#include <memory>

#include "core/error.h"
#include "models/batchnorm.h"
#include "models/conv.h"
#include "tensor/ops.h"

namespace mtrain::models {

Residual::Residual(int64_t in_channels, int64_t out_channels, bool use_1x1conv, int stride)
    : has_conv3_(use_1x1conv) {
  if (!use_1x1conv && (in_channels != out_channels || stride != 1)) {
    throw InvalidArgument(fmt::format(
        "Residual({}, {}, stride={}): an identity shortcut needs in_channels == out_channels "
        "and stride 1; pass use_1x1conv=true to project the shortcut",
        in_channels, out_channels, stride));
  }
  conv1_ = register_module("conv1", std::make_unique<Conv2d>(Conv2dOptions{
                                        .in_channels = in_channels,
                                        .out_channels = out_channels,
                                        .kernel_size = 3,
                                        .stride = stride,
                                        .padding = 1}));
  conv2_ = register_module("conv2", std::make_unique<Conv2d>(Conv2dOptions{
                                        .in_channels = out_channels,
                                        .out_channels = out_channels,
                                        .kernel_size = 3,
                                        .stride = 1,
                                        .padding = 1}));
  conv3_ = use_1x1conv ? register_module("conv3", std::make_unique<Conv2d>(Conv2dOptions{
                                                      .in_channels = in_channels,
                                                      .out_channels = out_channels,
                                                      .kernel_size = 1,
                                                      .stride = stride,
                                                      .padding = 0}))
                       : 0;
  bn1_ = register_module("bn1", std::make_unique<BatchNorm2d>(out_channels));
  bn2_ = register_module("bn2", std::make_unique<BatchNorm2d>(out_channels));
}

Tensor Residual::forward(const Tensor& x) {
  Tensor h = inner_relu_.forward(child(bn1_).forward(child(conv1_).forward(x)));
  h = child(bn2_).forward(child(conv2_).forward(h));
  const Tensor shortcut = has_conv3_ ? child(conv3_).forward(x) : x;
  if (shortcut.shape() != h.shape()) {
    throw InvalidArgument(fmt::format("Residual: main path gives {} but the shortcut gives {}",
                                      shape_str(h.shape()), shape_str(shortcut.shape())));
  }
  // A fresh sum rather than in place: the module in slot bn2 may keep its output (a
  // replacement is any Module) and x belongs to the caller.
  Tensor sum = Tensor::empty(h.shape(), DType::Float32, h.device());
  ops::add(h, shortcut, sum);
  return output_relu_.forward(sum);
}

Tensor Residual::backward(const Tensor& dy) {
  const Tensor dsum = output_relu_.backward(dy);
  // Reverse forward order: the shortcut conv ran last, so its gradients are final first.
  Tensor dx = has_conv3_ ? child(conv3_).backward(dsum) : dsum;
  Tensor dmain = child(conv2_).backward(child(bn2_).backward(dsum));
  dmain = child(conv1_).backward(child(bn1_).backward(inner_relu_.backward(dmain)));
  Tensor total = Tensor::empty(dmain.shape(), DType::Float32, dmain.device());
  ops::add(dmain, dx, total);
  return total;
}

}  // namespace mtrain::models
