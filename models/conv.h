// Conv2d: 2-D convolution over NCHW input with an OIHW weight (torch.nn.Conv2d with
// square kernel, stride and padding, dilation 1, any groups: the weight is
// [out, in / groups, k, k], depthwise when groups == in).
#pragma once

#include <cstdint>

#include "models/module.h"
#include "tensor/ops.h"

namespace mtrain::models {

struct Conv2dOptions {
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  int kernel_size = 3;
  int stride = 1;
  int padding = 0;
  bool bias = true;
  int groups = 1;  // divides in_channels and out_channels
  // Rectangular windows (Inception's 1x7 and 7x1): the width's kernel, stride and padding
  // where they differ from the height's, which are the three above; 0 (-1 for the padding)
  // means the same as the height's.
  int kernel_w = 0;
  int stride_w = 0;
  int padding_w = -1;
  // Dilated (atrous) convolution: taps `dilation` apart (ops::Conv2dParams); the width's
  // when it differs (0: the same).
  int dilation = 1;
  int dilation_w = 0;
};

class Conv2d : public Module {
 public:
  explicit Conv2d(const Conv2dOptions& options);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Conv2d"; }
  void reset_parameters(ParameterInitializer& init) override;

  const Conv2dOptions& options() const { return options_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }  // value undefined when options().bias is false
  // The type the convolution multiplies in (Note [Mixed precision] in mixed_precision.cpp).
  void set_compute_dtype(DType compute) { geometry_.compute = compute; }
  DType compute_dtype() const { return geometry_.compute; }
  // The type the output is stored in (Note [16-bit activations] in tensor/ops.h): float32, or
  // under MTRAIN_SPEEDUPS=amp-activations the compute type. The input gradient takes the
  // input's type, whatever this is.
  void set_activation_dtype(DType storage) { activation_dtype_ = storage; }
  DType activation_dtype() const { return activation_dtype_; }
  // Leaves the bias out of the output, for a batch norm after this layer that takes it
  // into account instead (Note [Conv bias before a batch norm] in models/rewrites.h): the
  // forward adds no bias, and a training backward leaves the bias gradient alone (its
  // exact value, with the batch norm subtracting the batch mean, is zero). An eval-mode
  // backward still sums it, as the batch norm then subtracts a constant.
  void set_bias_skipped(bool skipped) { bias_skipped_ = skipped && options_.bias; }
  bool bias_skipped() const { return bias_skipped_; }
  // Channels-last activations (Note [Channels last] in tensor/ops.h): input and output
  // [N, H, W, C]. With `nchw_input` the input comes [N, C, H, W] (the model's images) and
  // is laid out here, and its gradient goes back so. use_channels_last (models/rewrites.h)
  // sets it.
  void set_channels_last(bool on, bool nchw_input = false);
  bool channels_last() const { return geometry_.channels_last; }

 private:
  Conv2dOptions options_;
  std::string description_;  // "Conv2d(1, 64, kernel_size=3, ...)" for error messages
  ops::Conv2dParams geometry_;
  Parameter weight_;
  Parameter bias_;
  bool bias_skipped_ = false;
  bool nchw_input_ = false;
  DType activation_dtype_ = DType::Float32;
  Tensor input_;       // cached for backward
  Shape output_shape_;
  bool forward_was_training_ = false;
};

}  // namespace mtrain::models
