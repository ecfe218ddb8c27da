// BatchNorm2d over NCHW input (torch.nn.BatchNorm2d with affine=True, track_running_stats=True
// and a numeric momentum; torch's momentum=None cumulative average is not offered). Training mode
// has two virtual steps where SyncBatchNorm swaps local quantities for global ones (Note [Batch
// norm statistics hooks] in batchnorm.cpp); eval mode normalises with the running statistics and
// calls neither.
#pragma once

#include <cstdint>

#include "models/module.h"

namespace mtrain::models {

// Per-channel statistics of one training-mode batch.
struct BatchStats {
  Tensor mean;    // [C]
  Tensor var;     // [C], biased: sum (x - mean)^2 / count
  int64_t count;  // values per channel behind mean and var (N*H*W locally)
};

class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5, double momentum = 0.1);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "BatchNorm2d"; }
  // weight 1, bias 0, running_mean 0, running_var 1, num_batches_tracked 0.
  void reset_parameters(ParameterInitializer& init) override;

  // Copies weight, bias and the three buffers from `other` (same num_features).
  void copy_state_from(const BatchNorm2d& other);

  // Note [Batch norm with its ReLU]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A fused layer computes with the fused kernels (Note [Fused batch norm] in tensor/ops.h):
  // its running statistics and inverse deviation in one step (batchnorm_prepare) and,
  // with `relu`, the ReLU that follows it in its own passes: forward returns relu(bn(x))
  // and backward takes the gradient of that. fuse_batchnorm (models/rewrites.h) sets this
  // where a ReLU follows and takes that ReLU out of the model. Results are bitwise the
  // unfused layer's followed by the ReLU. Off by default.
  void set_fused(bool fused, bool relu);
  bool fused() const { return fused_; }
  bool fused_relu() const { return fused_ && relu_; }
  // relu(bn(x) + residual) in the fused kernels, whatever set_fused says (Residual's
  // last three steps); backward_add_relu is its backward and returns dL/dx, with
  // dL/d(residual) in `dresidual`. A plain backward() after it is an error, and the
  // other way round.
  Tensor forward_add_relu(const Tensor& x, const Tensor& residual);
  Tensor backward_add_relu(const Tensor& dy, Tensor& dresidual);

  // The bias of the Conv2d before this layer, which that layer no longer adds
  // (Conv2d::set_bias_skipped; Note [Conv bias before a batch norm] in models/rewrites.h):
  // the running mean then tracks the batch mean plus the bias, and eval mode subtracts
  // the bias from the running mean, so buffers and outputs are those of a convolution
  // that adds it. nullptr (the default): the input is taken as it comes.
  void set_input_bias(const Parameter* bias) { input_bias_ = bias; }
  const Parameter* input_bias() const { return input_bias_; }

  // Channels-last activations (Note [Channels last] in tensor/ops.h): input and output
  // [N, H, W, C], normalised through their [N*H*W, C] view. use_channels_last
  // (models/rewrites.h) sets it.
  void set_channels_last(bool on) { channels_last_ = on; }
  bool channels_last() const { return channels_last_; }

  int64_t num_features() const { return num_features_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  const Tensor& running_mean() const { return running_mean_; }
  const Tensor& running_var() const { return running_var_; }
  int64_t num_batches_tracked() const;

 protected:
  // Training mode only; identity here (Note [Batch norm statistics hooks]). merge_batch_stats
  // runs after the local statistics and must leave `stats` describing the batch the
  // normalisation is over (mean, biased var, element count per channel);
  // reduce_backward_sums runs after the weight and bias gradients are taken from the local sums.
  virtual void merge_batch_stats(BatchStats& stats) {}
  virtual void reduce_backward_sums(Tensor& sum_dy, Tensor& sum_dy_xmu) {}

  // "BatchNorm2d(64, eps=1e-05, momentum=0.1)", with the subclass's type name.
  std::string description() const;

 private:
  // What the last forward returned: bn(x), relu(bn(x)) or relu(bn(x) + residual).
  enum class Output { Plain, Relu, AddRelu };

  Tensor run_forward(const Tensor& x, const Tensor& residual, Output output);
  // Training-mode statistics: sets mean_, invstd_ and count_, updates the running ones.
  void take_batch_statistics(const Tensor& x);
  Tensor run_backward(const Tensor& dy, Tensor* dresidual);

  int64_t num_features_;
  double eps_;
  double momentum_;
  Parameter weight_;
  Parameter bias_;
  Tensor running_mean_;
  Tensor running_var_;
  Tensor num_batches_tracked_;  // int64 scalar, shape []

  bool fused_ = false;
  bool relu_ = false;
  const Parameter* input_bias_ = nullptr;
  bool channels_last_ = false;

  // Cached by forward for backward.
  Output output_kind_ = Output::Plain;
  Shape shape_;    // of the input and output, as the caller sees them
  Tensor output_;  // the ReLU's mask (not Plain)
  Tensor input_;   // as the kernels see it (channels last: the [N*H*W, C] view)
  Tensor mean_;    // batch (train) or running (eval) mean used to normalise
  Tensor invstd_;  // 1 / sqrt(var + eps) for that var
  int64_t count_ = 0;
  bool forward_was_training_ = false;
};

}  // namespace mtrain::models
