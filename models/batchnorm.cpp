#include "models/batchnorm.h"

#include <cmath>

#include "core/error.h"
#include "models/input_checks.h"
#include "tensor/ops.h"

namespace mtrain::models {

namespace {
// invstd[c] = 1 / sqrt(var[c] + eps): C values, no kernel needed.
Tensor inverse_std(const Tensor& var, double eps) {
  Tensor invstd = Tensor::empty(var.shape());
  const float* v = var.data<float>();
  float* out = invstd.data<float>();
  for (int64_t c = 0; c < var.numel(); ++c) {
    out[c] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(v[c]) + eps));
  }
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
  return num_batches_tracked_.data<int64_t>()[0];
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  detail::check_image_batch(description(), x, num_features_);
  forward_was_training_ = is_training();
  if (forward_was_training_) {
    BatchStats stats{Tensor::empty({num_features_}), Tensor::empty({num_features_}),
                     x.size(0) * x.size(2) * x.size(3)};
    ops::batchnorm_stats(x, stats.mean, stats.var);
    merge_batch_stats(stats);
    // The unbiased running variance divides by count - 1 (torch raises the same error).
    if (stats.count <= 1) {
      throw InvalidArgument(fmt::format(
          "{}: expected more than 1 value per channel when training, found {} (input {})",
          description(), stats.count, shape_str(x.shape())));
    }
    update_running_stats(stats);
    mean_ = stats.mean;
    invstd_ = inverse_std(stats.var, eps_);
    count_ = stats.count;
  } else {
    mean_ = running_mean_.clone();
    invstd_ = inverse_std(running_var_, eps_);
    count_ = 0;
  }
  Tensor y = Tensor::empty(x.shape());
  ops::batchnorm_apply(x, mean_, invstd_, weight_.value, bias_.value, y);
  input_ = x;
  return y;
}

void BatchNorm2d::update_running_stats(const BatchStats& stats) {
  const float keep = static_cast<float>(1.0 - momentum_);
  const float take = static_cast<float>(momentum_);
  const double unbias = static_cast<double>(stats.count) / static_cast<double>(stats.count - 1);
  ops::scale_(running_mean_, keep);
  ops::add_(running_mean_, stats.mean, take);
  ops::scale_(running_var_, keep);
  ops::add_(running_var_, stats.var, static_cast<float>(momentum_ * unbias));
  num_batches_tracked_.data<int64_t>()[0] += 1;
}

Tensor BatchNorm2d::backward(const Tensor& dy) {
  detail::check_output_grad(description(), dy, input_.defined() ? input_.shape() : Shape{});
  Tensor sum_dy = Tensor::empty({num_features_});
  Tensor sum_dy_xmu = Tensor::empty({num_features_});
  ops::batchnorm_backward_reduce(dy, input_, mean_, sum_dy, sum_dy_xmu);

  // dL/dweight = sum dy * xhat = invstd * sum_dy_xmu; dL/dbias = sum dy. C values each.
  const float* sdy = sum_dy.data<float>();
  const float* sdyxmu = sum_dy_xmu.data<float>();
  const float* invstd = invstd_.data<float>();
  float* dweight = weight_.grad.data<float>();
  float* dbias = bias_.grad.data<float>();
  for (int64_t c = 0; c < num_features_; ++c) {
    dweight[c] += sdyxmu[c] * invstd[c];
    dbias[c] += sdy[c];
  }
  notify_grad_ready(bias_);
  notify_grad_ready(weight_);

  Tensor dx = Tensor::empty(input_.shape());
  if (forward_was_training_) {
    reduce_backward_sums(sum_dy, sum_dy_xmu);
    ops::batchnorm_backward_apply(dy, input_, mean_, invstd_, weight_.value, sum_dy, sum_dy_xmu,
                                  static_cast<double>(count_), dx);
  } else {
    // The running statistics are constants: dx = dy * weight * invstd.
    sum_dy.zero_();
    sum_dy_xmu.zero_();
    ops::batchnorm_backward_apply(dy, input_, mean_, invstd_, weight_.value, sum_dy, sum_dy_xmu,
                                  /*count=*/1.0, dx);
  }
  input_ = Tensor();  // Note [Saved tensors die with backward] (module.h)
  return dx;
}

}  // namespace mtrain::models
