// Residual: d2l's ResNet block (d2l.Residual):
//   y = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)),
// conv1 3x3 with stride s and padding 1, conv2 3x3 padding 1, shortcut = conv3 (1x1,
// stride s) when use_1x1conv, else the identity (then in == out channels and s == 1).
// Children are named and ordered as the torch attributes: conv1, conv2, [conv3], bn1,
// bn2 (Note [Parameter names]). They are reached through their slots, never through
// cached pointers, so replace_modules can swap bn1/bn2 for SyncBatchNorm.
#pragma once

#include <cstdint>

#include "models/activation.h"
#include "models/batchnorm.h"
#include "models/module.h"

namespace mtrain::models {

class Residual : public Module {
 public:
  Residual(int64_t in_channels, int64_t out_channels, bool use_1x1conv = false, int stride = 1);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Residual"; }

  bool has_shortcut_conv() const { return has_conv3_; }

  // The rewrites of models/rewrites.h inside the block. fuse_batchnorm: bn1 does the ReLU
  // after it and bn2 the add and the ReLU after it, in their own kernels (Note [Batch norm
  // with its ReLU] in batchnorm.h). skip_conv_bias: conv1 and conv2 leave their biases to
  // bn1 and bn2 (Note [Conv bias before a batch norm] in rewrites.h). Each needs the
  // children in the batch-norm slots to be BatchNorm2d (SyncBatchNorm is one) and returns
  // false, changing nothing, otherwise.
  bool fuse_batchnorm();
  bool skip_conv_bias();

 private:
  BatchNorm2d* batchnorm(size_t slot) const;

  bool has_conv3_;
  bool fused_ = false;
  size_t conv1_, conv2_, conv3_, bn1_, bn2_;  // child slots
  // torch's block calls F.relu: these hold state for backward but are not children.
  ReLU inner_relu_;
  ReLU output_relu_;
};

}  // namespace mtrain::models
