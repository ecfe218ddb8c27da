#include "models/conv.h"

#include "core/error.h"
#include "models/init.h"
#include "models/input_checks.h"
#include "models/layout.h"

namespace mtrain::models {

namespace {
// The width's kernel, stride and padding (Conv2dOptions: the height's unless given).
Conv2dOptions with_width(Conv2dOptions o) {
  if (o.kernel_w == 0) o.kernel_w = o.kernel_size;
  if (o.stride_w == 0) o.stride_w = o.stride;
  if (o.padding_w == -1) o.padding_w = o.padding;
  if (o.dilation_w == 0) o.dilation_w = o.dilation;
  return o;
}

// torch's repr: one number where height and width agree, (h, w) where they differ.
std::string describe(const Conv2dOptions& o) {
  const auto pair = [](int h, int w) { return h == w ? fmt::format("{}", h) : fmt::format("({}, {})", h, w); };
  return fmt::format("Conv2d({}, {}, kernel_size={}, stride={}, padding={}{}{}, bias={})", o.in_channels,
                     o.out_channels, pair(o.kernel_size, o.kernel_w), pair(o.stride, o.stride_w),
                     pair(o.padding, o.padding_w),
                     o.dilation == 1 && o.dilation_w == 1 ? std::string()
                                                          : fmt::format(", dilation={}", pair(o.dilation, o.dilation_w)),
                     o.groups == 1 ? std::string() : fmt::format(", groups={}", o.groups), o.bias);
}
}  // namespace

Conv2d::Conv2d(const Conv2dOptions& given)
    : options_(with_width(given)), description_(describe(options_)) {
  const Conv2dOptions& options = options_;
  if (options.in_channels < 1 || options.out_channels < 1 || options.kernel_size < 1 || options.kernel_w < 1 ||
      options.stride < 1 || options.stride_w < 1 || options.padding < 0 || options.padding_w < 0 ||
      options.dilation < 1 || options.dilation_w < 1 ||
      options.groups < 1 || options.in_channels % options.groups != 0 || options.out_channels % options.groups != 0) {
    throw InvalidArgument(fmt::format(
        "{}: expected in_channels, out_channels, kernel_size, stride, dilation >= 1, padding >= 0 and groups >= 1 "
        "dividing both channel counts",
        description_));
  }
  geometry_.stride_h = options.stride;
  geometry_.stride_w = options.stride_w;
  geometry_.pad_h = options.padding;
  geometry_.pad_w = options.padding_w;
  geometry_.groups = options.groups;
  geometry_.dilation_h = options.dilation;
  geometry_.dilation_w = options.dilation_w;
  register_parameter("weight", weight_,
                     {options.out_channels, options.in_channels / options.groups, options.kernel_size, options.kernel_w});
  if (options.bias) register_parameter("bias", bias_, {options.out_channels});
}

void Conv2d::reset_parameters(ParameterInitializer& init) {
  // torch's fan_in: the weight's dimension 1 (in / groups) times the kernel's area.
  const int64_t fan_in = options_.in_channels / options_.groups * options_.kernel_size * options_.kernel_w;
  init.init_weight(weight_.value, fan_in);
  if (options_.bias) init.init_bias(bias_.value, fan_in);
}

void Conv2d::set_channels_last(bool on, bool nchw_input) {
  geometry_.channels_last = on;
  nchw_input_ = on && nchw_input;
}

// Channels last (Note [Channels last] in tensor/ops.h): the kernels see [N, H, W, C]; a
// layer that takes the model's images lays them out first.
Tensor Conv2d::forward(const Tensor& input) {
  const bool last = geometry_.channels_last;
  if (last && !nchw_input_) {
    detail::check_image_batch_channels_last(description_, input, options_.in_channels);
  } else {
    detail::check_image_batch(description_, input, options_.in_channels);
  }
  detail::check_input_device(description_, input, weight_.value);
  const Tensor x = nchw_input_ ? channels_last_copy(input) : input;
  const int64_t h = last ? x.size(1) : x.size(2), w = last ? x.size(2) : x.size(3);
  const int64_t oh = ops::conv_out_size(h, options_.kernel_size, options_.stride, options_.padding, options_.dilation);
  const int64_t ow = ops::conv_out_size(w, options_.kernel_w, options_.stride_w, options_.padding_w, options_.dilation_w);
  if (oh < 1 || ow < 1) {
    throw InvalidArgument(fmt::format("{}: input {} is smaller than the kernel", description_,
                                      shape_str(input.shape())));
  }
  const int64_t n = x.size(0), o = options_.out_channels;
  Tensor y = Tensor::empty(last ? Shape{n, oh, ow, o} : Shape{n, o, oh, ow}, activation_dtype_, x.device());
  ops::conv2d_forward(x, weight_.value, bias_skipped_ ? Tensor() : bias_.value, y, geometry_);
  input_ = x;
  output_shape_ = y.shape();
  forward_was_training_ = is_training();
  return y;
}

Tensor Conv2d::backward(const Tensor& dy) {
  detail::check_output_grad(description_, dy, output_shape_);
  detail::check_output_grad_device(description_, dy, input_.device());
  // Parameter gradients first, so the reducer can start on them while dx is computed.
  Tensor bias_grad = bias_skipped_ && forward_was_training_ ? Tensor() : bias_.grad;
  // One flag covers both gradients (Note [Gradient accumulation in modules]).
  const bool weight_fresh = take_fresh(weight_);
  const bool bias_fresh = !bias_grad.defined() || take_fresh(bias_);
  ops::conv2d_backward_weights(input_, dy, weight_.grad, bias_grad, geometry_,
                               /*accumulate=*/!(weight_fresh && bias_fresh));
  if (options_.bias) notify_grad_ready(bias_);
  notify_grad_ready(weight_);
  Tensor dx;
  if (input_grad_needed()) {
    dx = Tensor::empty(input_.shape(), input_.dtype(), input_.device());
    ops::conv2d_backward_data(dy, weight_.value, dx, geometry_);
    if (nchw_input_) dx = channels_first_copy(dx);
  }
  input_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  output_shape_ = {};
  return dx;
}

}  // namespace mtrain::models
