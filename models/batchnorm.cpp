#include "models/batchnorm.h"

#include "core/error.h"
#include "models/input_checks.h"
#include "tensor/ops.h"

namespace mtrain::models {

namespace {
// Per-channel float32 tensor on `device`.
Tensor channel_tensor(int64_t channels, Device device) {
  return Tensor::empty({channels}, DType::Float32, device);
}

Tensor inverse_std(const Tensor& var, double eps) {
  Tensor invstd = channel_tensor(var.numel(), var.device());
  ops::batchnorm_invstd(var, eps, invstd);
  return invstd;
}
}  // namespace

BatchNorm2d::BatchNorm2d(int64_t num_features, double eps, double momentum)
    : num_features_(num_features), eps_(eps), momentum_(momentum) {
  if (num_features < 1 || !(eps > 0.0) || !(momentum >= 0.0 && momentum <= 1.0)) {
    throw InvalidArgument(fmt::format(
        "BatchNorm2d: expected num_features >= 1, eps > 0 and momentum in [0, 1], found "
        "num_features={}, eps={}, momentum={}",
        num_features, eps, momentum));
  }
  register_parameter("weight", weight_, {num_features});
  register_parameter("bias", bias_, {num_features});
  running_mean_ = Tensor::zeros({num_features});
  running_var_ = Tensor::full({num_features}, 1.0f);
  num_batches_tracked_ = Tensor::zeros({}, DType::Int64);
  register_buffer("running_mean", running_mean_);
  register_buffer("running_var", running_var_);
  register_buffer("num_batches_tracked", num_batches_tracked_);
  weight_.value.fill_(1.0f);
}

std::string BatchNorm2d::description() const {
  return fmt::format("{}({}, eps={}, momentum={})", type_name(), num_features_, eps_, momentum_);
}

void BatchNorm2d::reset_parameters(ParameterInitializer& init) {
  weight_.value.fill_(1.0f);
  bias_.value.zero_();
  running_mean_.zero_();
  running_var_.fill_(1.0f);
  num_batches_tracked_.zero_();
}

void BatchNorm2d::copy_state_from(const BatchNorm2d& other) {
  MTRAIN_CHECK(other.num_features_ == num_features_, "copying {} into {}", other.description(),
               description());
  weight_.value.copy_(other.weight_.value);
  bias_.value.copy_(other.bias_.value);
  running_mean_.copy_(other.running_mean_);
  running_var_.copy_(other.running_var_);
  num_batches_tracked_.copy_(other.num_batches_tracked_);
}

int64_t BatchNorm2d::num_batches_tracked() const {
  // On a GPU this waits for the queued forwards: callers read it between steps.
  return num_batches_tracked_.to(Device::cpu()).data<int64_t>()[0];
}

void BatchNorm2d::set_fused(bool fused, bool relu) {
  fused_ = fused;
  relu_ = fused && relu;
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  return run_forward(x, Tensor(), fused_relu() ? Output::Relu : Output::Plain);
}

Tensor BatchNorm2d::forward_add_relu(const Tensor& x, const Tensor& residual) {
  if (!residual.defined() || residual.shape() != x.shape() || residual.device() != x.device()) {
    throw InvalidArgument(fmt::format("{}: the residual added to the output must match the input {}, found {}",
                                      description(), x.str(), residual.defined() ? residual.str() : "none"));
  }
  return run_forward(x, residual, Output::AddRelu);
}

// Note [Batch norm statistics hooks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Training mode follows Note [Separable batch norm] in tensor/ops.h, with two virtual steps where
// SyncBatchNorm (a subclass) swaps local quantities for global ones:
//   forward:  batchnorm_stats -> merge_batch_stats(stats) -> batchnorm_apply,
//             running stats updated from the merged mean/var/count;
//   backward: batchnorm_backward_reduce -> weight/bias grads from the LOCAL sums (DDP
//             all-reduces them like any other gradient) -> reduce_backward_sums(sum_dy,
//             sum_dy_xmu) -> batchnorm_backward_apply with the merged count.
// The base class leaves both steps as identity. Eval mode normalises with the running statistics
// and never calls either step (torch's SyncBatchNorm does not sync in eval). convert_sync_batchnorm
// uses replace_modules (module.h) and copy_state_from. A fused layer (Note [Batch norm with its
// ReLU] in batchnorm.h) runs the same steps with the _relu variants of the apply and backward
// kernels, and batchnorm_prepare for the running statistics and the inverse deviation.
Tensor BatchNorm2d::run_forward(const Tensor& input, const Tensor& residual_input, Output output) {
  if (channels_last_) {
    detail::check_image_batch_channels_last(description(), input, num_features_);
  } else {
    detail::check_image_batch(description(), input, num_features_);
  }
  detail::check_input_device(description(), input, weight_.value);
  // Channels last, the kernels take the [N*H*W, C] view (Note [Channels last] in tensor/ops.h).
  shape_ = input.shape();
  const Tensor x = channels_last_ ? input.view({-1, num_features_}) : input;
  const Tensor residual = residual_input.defined() ? residual_input.view(x.shape()) : Tensor();
  forward_was_training_ = is_training();
  if (forward_was_training_) {
    take_batch_statistics(x);
  } else {
    mean_ = running_mean_.clone();
    if (input_bias_ != nullptr) ops::add_(mean_, input_bias_->value, -1.0f);
    invstd_ = inverse_std(running_var_, eps_);
    count_ = 0;
  }
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (output == Output::Plain) {
    ops::batchnorm_apply(x, mean_, invstd_, weight_.value, bias_.value, y);
    output_ = Tensor();
  } else {
    ops::batchnorm_apply_relu(x, mean_, invstd_, weight_.value, bias_.value, residual, y);
    output_ = y;
  }
  output_kind_ = output;
  input_ = x;
  return y.view(shape_);
}

void BatchNorm2d::take_batch_statistics(const Tensor& x) {
  // Per channel: N*H*W values of [N, C, H, W], M of [M, C].
  BatchStats stats{channel_tensor(num_features_, x.device()),
                   channel_tensor(num_features_, x.device()), x.numel() / num_features_};
  ops::batchnorm_stats(x, stats.mean, stats.var);
  merge_batch_stats(stats);
  // The unbiased running variance divides by count - 1 (torch raises the same error).
  if (stats.count <= 1) {
    throw InvalidArgument(fmt::format(
        "{}: expected more than 1 value per channel when training, found {} (input {})",
        description(), stats.count, shape_str(x.shape())));
  }
  mean_ = stats.mean;
  count_ = stats.count;
  // The running mean is the mean of what the layer before produces, its bias included.
  if (input_bias_ != nullptr) {
    stats.mean = channel_tensor(num_features_, x.device());
    ops::add(mean_, input_bias_->value, stats.mean);
  }
  if (fused_) {
    invstd_ = channel_tensor(num_features_, x.device());
    ops::batchnorm_prepare(stats.mean, stats.var, stats.count, momentum_, eps_, running_mean_,
                           running_var_, num_batches_tracked_, invstd_);
  } else {
    ops::batchnorm_update_running(stats.mean, stats.var, stats.count, momentum_, running_mean_,
                                  running_var_, num_batches_tracked_);
    invstd_ = inverse_std(stats.var, eps_);
  }
}

Tensor BatchNorm2d::backward(const Tensor& dy) {
  if (output_kind_ == Output::AddRelu && input_.defined()) {
    throw InternalError(fmt::format("{}: backward() after forward_add_relu(); call backward_add_relu()",
                                    description()));
  }
  return run_backward(dy, nullptr);
}

Tensor BatchNorm2d::backward_add_relu(const Tensor& dy, Tensor& dresidual) {
  if (output_kind_ != Output::AddRelu && input_.defined()) {
    throw InternalError(fmt::format("{}: backward_add_relu() after a forward without the residual",
                                    description()));
  }
  return run_backward(dy, &dresidual);
}

Tensor BatchNorm2d::run_backward(const Tensor& output_grad, Tensor* dresidual) {
  detail::check_output_grad(description(), output_grad, input_.defined() ? shape_ : Shape{});
  const Device device = input_.device();
  detail::check_output_grad_device(description(), output_grad, device);
  const Tensor dy = output_grad.view(input_.shape());
  const bool masked = output_kind_ != Output::Plain;
  Tensor sum_dy = channel_tensor(num_features_, device);
  Tensor sum_dy_xmu = channel_tensor(num_features_, device);
  if (masked) {
    ops::batchnorm_backward_reduce_relu(dy, output_, input_, mean_, sum_dy, sum_dy_xmu);
  } else {
    ops::batchnorm_backward_reduce(dy, input_, mean_, sum_dy, sum_dy_xmu);
  }

  // dL/dweight = sum dy * xhat = invstd * sum_dy_xmu; dL/dbias = sum dy.
  ops::batchnorm_param_grads(sum_dy, sum_dy_xmu, invstd_, weight_.grad, bias_.grad);
  notify_grad_ready(bias_);
  notify_grad_ready(weight_);

  double count = static_cast<double>(count_);
  if (forward_was_training_) {
    reduce_backward_sums(sum_dy, sum_dy_xmu);
  } else {
    // The running statistics are constants: dx = dy * weight * invstd.
    sum_dy.zero_();
    sum_dy_xmu.zero_();
    count = 1.0;
  }
  Tensor dx = Tensor::empty(input_.shape(), input_.dtype(), device);
  if (masked) {
    if (dresidual != nullptr) *dresidual = Tensor::empty(input_.shape(), input_.dtype(), device);
    Tensor no_residual;
    ops::batchnorm_backward_apply_relu(dy, output_, input_, mean_, invstd_, weight_.value, sum_dy,
                                       sum_dy_xmu, count, dx,
                                       dresidual != nullptr ? *dresidual : no_residual);
  } else {
    ops::batchnorm_backward_apply(dy, input_, mean_, invstd_, weight_.value, sum_dy, sum_dy_xmu,
                                  count, dx);
  }
  input_ = Tensor();  // Note [Saved tensors die with backward] (module.cpp)
  output_ = Tensor();
  if (dresidual != nullptr) *dresidual = dresidual->view(shape_);
  return dx.view(shape_);
}

}  // namespace mtrain::models
