// torchvision's ResNets for ImageNet-size images (--model resnet34, --model resnet50): the
// 7x7 stem with max pooling, BasicBlocks (resnet34) or Bottlenecks (resnet50) in four
// stages, global average pooling and fc, with torchvision's parameter names (conv1, bn1,
// layer1.0.conv1, layer2.0.downsample.0, fc), so that torchvision.models.resnet50(
// num_classes=K) loads what mtrain saves with load_state_dict, and mtrain's --init-from
// loads torchvision's weights. (--model resnet18 is d2l's network for 28x28 images.)
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "models/activation.h"
#include "models/module.h"

namespace mtrain::models {

// One block of torchvision's ResNet: y = relu(main(x) + shortcut(x)) with
//   BasicBlock:  main = bn2(conv2(relu(bn1(conv1(x))))), both convolutions 3x3, conv1 at
//                the block's stride;
//   Bottleneck:  main = bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))), conv1 1x1 to
//                `planes`, conv2 3x3 at the block's stride, conv3 1x1 to 4 x planes;
// shortcut = downsample (a 1x1 convolution at the stride and a batch norm, children "0"
// and "1") where the shape changes, else x. No convolution has a bias. Children are
// reached through their slots, so convert_sync_batchnorm can replace the batch norms.
class ResNetBlock : public Module {
 public:
  enum class Kind { kBasic, kBottleneck };
  ResNetBlock(Kind kind, int64_t in_channels, int64_t planes, int stride);

  // Output channels per `planes`: 1 for BasicBlock, 4 for Bottleneck.
  static int64_t expansion(Kind kind) { return kind == Kind::kBottleneck ? 4 : 1; }

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "ResNetBlock"; }

 private:
  std::vector<size_t> convs_, bns_;  // slots of conv1.., bn1.., in forward order
  std::optional<size_t> downsample_;
  // torch's blocks call self.relu, a module without state: these hold the state for
  // backward but are not children.
  std::array<ReLU, 2> inner_relus_;
  ReLU output_relu_;
};

// torchvision.models.resnet34 or resnet50 (`depth` 34 or 50) for `num_classes` classes, its
// first convolution taking `in_channels` (torchvision's takes 3). InvalidArgument for
// another depth.
std::unique_ptr<Module> torchvision_resnet(int depth, int64_t in_channels, int64_t num_classes);

}  // namespace mtrain::models
