#include "models/torchvision_resnet.h"

#include "core/error.h"
#include "models/batchnorm.h"
#include "models/conv.h"
#include "models/flatten.h"
#include "models/linear.h"
#include "models/pooling.h"
#include "models/sequential.h"
#include "tensor/ops.h"

namespace mtrain::models {

namespace {

std::unique_ptr<Conv2d> conv(int64_t in, int64_t out, int kernel, int stride) {
  return std::make_unique<Conv2d>(Conv2dOptions{.in_channels = in,
                                                .out_channels = out,
                                                .kernel_size = kernel,
                                                .stride = stride,
                                                .padding = kernel / 2,
                                                .bias = false});
}

}  // namespace

ResNetBlock::ResNetBlock(Kind kind, int64_t in_channels, int64_t planes, int stride) {
  const int64_t out_channels = planes * expansion(kind);
  // (kernel, stride, input channels, output channels) of conv1, conv2[, conv3].
  struct Layer {
    int kernel, stride;
    int64_t in, out;
  };
  const std::vector<Layer> layers =
      kind == Kind::kBasic
          ? std::vector<Layer>{{3, stride, in_channels, planes}, {3, 1, planes, planes}}
          : std::vector<Layer>{{1, 1, in_channels, planes}, {3, stride, planes, planes}, {1, 1, planes, out_channels}};
  // torch registers conv1, bn1, conv2, bn2, ... in that order (Note [Parameter names]).
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = layers[i];
    convs_.push_back(register_module(fmt::format("conv{}", i + 1), conv(l.in, l.out, l.kernel, l.stride)));
    bns_.push_back(register_module(fmt::format("bn{}", i + 1), std::make_unique<BatchNorm2d>(l.out)));
  }
  if (stride != 1 || in_channels != out_channels) {
    downsample_ = register_module(
        "downsample", make_sequential(conv(in_channels, out_channels, 1, stride), std::make_unique<BatchNorm2d>(out_channels)));
  }
}

Tensor ResNetBlock::forward(const Tensor& x) {
  Tensor h = x;
  for (size_t i = 0; i < convs_.size(); ++i) {
    h = child(bns_[i]).forward(child(convs_[i]).forward(h));
    if (i + 1 < convs_.size()) h = inner_relus_[i].forward(h);
  }
  const Tensor shortcut = downsample_ ? child(*downsample_).forward(x) : x;
  if (shortcut.shape() != h.shape()) {
    throw InvalidArgument(fmt::format("ResNetBlock: main path gives {} but the shortcut gives {}",
                                      shape_str(h.shape()), shape_str(shortcut.shape())));
  }
  Tensor sum = Tensor::empty(h.shape(), h.dtype(), h.device());
  ops::add(h, shortcut, sum);
  return output_relu_.forward(sum);
}

Tensor ResNetBlock::backward(const Tensor& dy) {
  const Tensor dsum = output_relu_.backward(dy);
  // Reverse forward order: the downsample ran last, so its gradients are final first.
  const Tensor dshortcut = downsample_ ? child(*downsample_).backward(dsum) : dsum;
  Tensor d = dsum;
  for (size_t i = convs_.size(); i-- > 0;) {
    if (i + 1 < convs_.size()) d = inner_relus_[i].backward(d);
    d = child(convs_[i]).backward(child(bns_[i]).backward(d));
  }
  Tensor total = Tensor::empty(d.shape(), d.dtype(), d.device());
  ops::add(d, dshortcut, total);
  return total;
}

std::unique_ptr<Module> torchvision_resnet(int depth, int64_t in_channels, int64_t num_classes) {
  if (depth != 34 && depth != 50) {
    throw InvalidArgument(fmt::format("torchvision_resnet: depth 34 or 50, found {}", depth));
  }
  const ResNetBlock::Kind kind = depth == 50 ? ResNetBlock::Kind::kBottleneck : ResNetBlock::Kind::kBasic;
  const std::array<int, 4> blocks = {3, 4, 6, 3};  // both depths
  auto model = std::make_unique<Sequential>();
  model->append("conv1", std::make_unique<Conv2d>(Conv2dOptions{.in_channels = in_channels,
                                                                .out_channels = 64,
                                                                .kernel_size = 7,
                                                                .stride = 2,
                                                                .padding = 3,
                                                                .bias = false}));
  model->append("bn1", std::make_unique<BatchNorm2d>(64));
  model->append("relu", std::make_unique<ReLU>());
  model->append("maxpool", std::make_unique<MaxPool2d>(Pool2dOptions{.kernel_size = 3, .stride = 2, .padding = 1}));
  int64_t channels = 64;
  for (size_t stage = 0; stage < blocks.size(); ++stage) {
    const int64_t planes = int64_t{64} << stage;
    auto layer = std::make_unique<Sequential>();
    for (int b = 0; b < blocks[stage]; ++b) {
      const int stride = b == 0 && stage > 0 ? 2 : 1;
      layer->append(std::make_unique<ResNetBlock>(kind, channels, planes, stride));
      channels = planes * ResNetBlock::expansion(kind);
    }
    model->append(fmt::format("layer{}", stage + 1), std::move(layer));
  }
  model->append("avgpool", std::make_unique<AdaptiveAvgPool2d>(1));
  model->append("flatten", std::make_unique<Flatten>());
  model->append("fc", std::make_unique<Linear>(channels, num_classes));
  return model;
}

}  // namespace mtrain::models
