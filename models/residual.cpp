#include "models/residual.h"

#include <memory>
#include <utility>

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

BatchNorm2d* Residual::batchnorm(size_t slot) const {
  return dynamic_cast<BatchNorm2d*>(&child(slot));
}

bool Residual::fuse_batchnorm() {
  BatchNorm2d* bn1 = batchnorm(bn1_);
  BatchNorm2d* bn2 = batchnorm(bn2_);
  if (bn1 == nullptr || bn2 == nullptr) return false;
  bn1->set_fused(true, /*relu=*/true);
  bn2->set_fused(true, /*relu=*/false);  // forward_add_relu does its ReLU
  fused_ = true;
  return true;
}

bool Residual::skip_conv_bias() {
  BatchNorm2d* bn1 = batchnorm(bn1_);
  BatchNorm2d* bn2 = batchnorm(bn2_);
  auto* conv1 = dynamic_cast<Conv2d*>(&child(conv1_));
  auto* conv2 = dynamic_cast<Conv2d*>(&child(conv2_));
  if (bn1 == nullptr || bn2 == nullptr || conv1 == nullptr || conv2 == nullptr) return false;
  for (auto [conv, bn] : {std::pair{conv1, bn1}, std::pair{conv2, bn2}}) {
    conv->set_bias_skipped(true);
    bn->set_input_bias(conv->bias_skipped() ? &conv->bias() : nullptr);
  }
  return true;
}

// A fused block (fuse_batchnorm) runs bn1 with its ReLU and ends in bn2's add and ReLU,
// so its inner_relu_ and output_relu_ stay idle; bn2 then hands back the gradient of the
// sum, which the shortcut takes, with its own input gradient.
Tensor Residual::forward(const Tensor& x) {
  Tensor h = child(bn1_).forward(child(conv1_).forward(x));
  if (!fused_) h = inner_relu_.forward(h);
  h = child(conv2_).forward(h);
  const Tensor shortcut = has_conv3_ ? child(conv3_).forward(x) : x;
  if (shortcut.shape() != h.shape()) {
    throw InvalidArgument(fmt::format("Residual: main path gives {} but the shortcut gives {}",
                                      shape_str(h.shape()), shape_str(shortcut.shape())));
  }
  if (fused_) return batchnorm(bn2_)->forward_add_relu(h, shortcut);
  h = child(bn2_).forward(h);
  // A fresh sum rather than in place: the module in slot bn2 may keep its output (a
  // replacement is any Module) and x belongs to the caller.
  Tensor sum = Tensor::empty(h.shape(), h.dtype(), h.device());
  ops::add(h, shortcut, sum);
  return output_relu_.forward(sum);
}

Tensor Residual::backward(const Tensor& dy) {
  Tensor dsum, dmain;
  if (fused_) {
    dmain = batchnorm(bn2_)->backward_add_relu(dy, dsum);
  } else {
    dsum = output_relu_.backward(dy);
  }
  // Reverse forward order: the shortcut conv ran last, so its gradients are final first.
  Tensor dx = has_conv3_ ? child(conv3_).backward(dsum) : dsum;
  if (!fused_) dmain = child(bn2_).backward(dsum);
  dmain = child(conv2_).backward(dmain);
  if (!fused_) dmain = inner_relu_.backward(dmain);
  dmain = child(conv1_).backward(child(bn1_).backward(dmain));
  Tensor total = Tensor::empty(dmain.shape(), dmain.dtype(), dmain.device());
  ops::add(dmain, dx, total);
  return total;
}

}  // namespace mtrain::models
