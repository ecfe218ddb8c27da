// Pooling layers over NCHW input: MaxPool2d and AvgPool2d (square windows, floor
// output size or, for MaxPool2d, ceil_mode's, AvgPool2d counting padding as torch's default count_include_pad=True)
// and AdaptiveAvgPool2d with output size 1 (global average pooling).
#pragma once

#include <cstdint>
#include <string>

#include "models/module.h"
#include "tensor/ops.h"

namespace mtrain::models {

// stride 0 means "same as kernel_size", as torch's stride=None.
struct Pool2dOptions {
  int kernel_size = 2;
  int stride = 0;
  int padding = 0;
  bool ceil_mode = false;  // MaxPool2d only (ops::Pool2dParams::ceil_mode)
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(const Pool2dOptions& options);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "MaxPool2d"; }

 private:
  std::string description_;
  ops::Pool2dParams window_;
  Tensor argmax_;  // Int32, shape of the output
  Shape input_shape_;
  DType input_dtype_ = DType::Float32;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(const Pool2dOptions& options);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "AvgPool2d"; }

 private:
  std::string description_;
  ops::Pool2dParams window_;
  Shape input_shape_;
  DType input_dtype_ = DType::Float32;
  Shape output_shape_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  // Only output_size 1 exists in the zoo; any other size is InvalidArgument.
  explicit AdaptiveAvgPool2d(int output_size = 1);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "AdaptiveAvgPool2d"; }
  // Channels-last input and output (Note [Channels last] in tensor/ops.h): [N, H, W, C]
  // to [N, 1, 1, C].
  void set_channels_last(bool on) { channels_last_ = on; }

 private:
  bool channels_last_ = false;
  Shape input_shape_;
  DType input_dtype_ = DType::Float32;
  Shape output_shape_;
};

}  // namespace mtrain::models
