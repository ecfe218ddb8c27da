#include "models/pooling.h"

#include "core/error.h"
#include "models/input_checks.h"

namespace mtrain::models {

namespace {
ops::Pool2dParams make_window(const std::string& description, const Pool2dOptions& o) {
  const int stride = o.stride == 0 ? o.kernel_size : o.stride;
  // torch rejects padding above half the window: such a window could be all padding.
  if (o.kernel_size < 1 || stride < 1 || o.padding < 0 || o.padding > o.kernel_size / 2) {
    throw InvalidArgument(fmt::format(
        "{}: expected kernel_size >= 1, stride >= 1 (or 0 for kernel_size) and "
        "0 <= padding <= kernel_size / 2",
        description));
  }
  ops::Pool2dParams p;
  p.kernel_h = p.kernel_w = o.kernel_size;
  p.stride_h = p.stride_w = stride;
  p.pad_h = p.pad_w = o.padding;
  p.ceil_mode = o.ceil_mode;
  return p;
}

std::string describe(const char* type, const Pool2dOptions& o) {
  return fmt::format("{}(kernel_size={}, stride={}, padding={}{})", type, o.kernel_size,
                     o.stride == 0 ? o.kernel_size : o.stride, o.padding, o.ceil_mode ? ", ceil_mode=True" : "");
}

Shape pooled_shape(const std::string& description, const Tensor& x,
                   const ops::Pool2dParams& p) {
  detail::check_image_batch(description, x, -1);
  const int64_t oh = ops::pool_out_size(x.size(2), p.kernel_h, p.stride_h, p.pad_h, p.ceil_mode);
  const int64_t ow = ops::pool_out_size(x.size(3), p.kernel_w, p.stride_w, p.pad_w, p.ceil_mode);
  if (oh < 1 || ow < 1) {
    throw InvalidArgument(fmt::format("{}: input {} is smaller than the window", description,
                                      shape_str(x.shape())));
  }
  return {x.size(0), x.size(1), oh, ow};
}
}  // namespace

MaxPool2d::MaxPool2d(const Pool2dOptions& options)
    : description_(describe("MaxPool2d", options)), window_(make_window(description_, options)) {}

Tensor MaxPool2d::forward(const Tensor& x) {
  const Shape out_shape = pooled_shape(description_, x, window_);
  Tensor y = Tensor::empty(out_shape, x.dtype(), x.device());
  argmax_ = Tensor::empty(out_shape, DType::Int32, x.device());
  ops::maxpool2d_forward(x, y, argmax_, window_);
  input_shape_ = x.shape();
  input_dtype_ = x.dtype();
  return y;
}

Tensor MaxPool2d::backward(const Tensor& dy) {
  detail::check_output_grad(description_, dy, argmax_.defined() ? argmax_.shape() : Shape{});
  detail::check_output_grad_device(description_, dy, argmax_.device());
  Tensor dx = Tensor::empty(input_shape_, input_dtype_, dy.device());
  ops::maxpool2d_backward(dy, argmax_, dx);
  argmax_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

AvgPool2d::AvgPool2d(const Pool2dOptions& options)
    : description_(describe("AvgPool2d", options)), window_(make_window(description_, options)) {
  if (options.ceil_mode) {
    throw InvalidArgument(fmt::format("{}: ceil_mode is offered by MaxPool2d only", description_));
  }
}

Tensor AvgPool2d::forward(const Tensor& x) {
  Tensor y = Tensor::empty(pooled_shape(description_, x, window_), x.dtype(), x.device());
  ops::avgpool2d_forward(x, y, window_);
  input_shape_ = x.shape();
  input_dtype_ = x.dtype();
  output_shape_ = y.shape();
  return y;
}

Tensor AvgPool2d::backward(const Tensor& dy) {
  detail::check_output_grad(description_, dy, output_shape_);
  // Nothing saved but shapes: dx goes wherever dy is, and the kernel needs nothing else.
  Tensor dx = Tensor::empty(input_shape_, input_dtype_, dy.device());
  ops::avgpool2d_backward(dy, dx, window_);
  output_shape_ = {};  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(int output_size) {
  if (output_size != 1) {
    throw InvalidArgument(fmt::format(
        "AdaptiveAvgPool2d: only output_size 1 (global average pooling) is implemented, "
        "found {}",
        output_size));
  }
}

Tensor AdaptiveAvgPool2d::forward(const Tensor& x) {
  if (channels_last_) {
    detail::check_image_batch_channels_last("AdaptiveAvgPool2d(1)", x, -1);
  } else {
    detail::check_image_batch("AdaptiveAvgPool2d(1)", x, -1);
  }
  const int64_t h = channels_last_ ? x.size(1) : x.size(2), w = channels_last_ ? x.size(2) : x.size(3);
  if (h < 1 || w < 1) {
    throw InvalidArgument(fmt::format("AdaptiveAvgPool2d(1): input {} has an empty plane",
                                      shape_str(x.shape())));
  }
  const int64_t c = channels_last_ ? x.size(3) : x.size(1);
  Tensor y = Tensor::empty(channels_last_ ? Shape{x.size(0), 1, 1, c} : Shape{x.size(0), c, 1, 1}, x.dtype(),
                           x.device());
  if (channels_last_) {
    ops::global_avgpool_forward_channels_last(x, y);
  } else {
    ops::global_avgpool_forward(x, y);
  }
  input_shape_ = x.shape();
  input_dtype_ = x.dtype();
  output_shape_ = y.shape();
  return y;
}

Tensor AdaptiveAvgPool2d::backward(const Tensor& dy) {
  detail::check_output_grad("AdaptiveAvgPool2d(1)", dy, output_shape_);
  Tensor dx = Tensor::empty(input_shape_, input_dtype_, dy.device());
  if (channels_last_) {
    ops::global_avgpool_backward_channels_last(dy, dx);
  } else {
    ops::global_avgpool_backward(dy, dx);
  }
  output_shape_ = {};  // Note [Saved tensors die with backward] (module.cpp)
  return dx;
}

}  // namespace mtrain::models
