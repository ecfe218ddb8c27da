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
  void update_running_stats(const BatchStats& stats);

  int64_t num_features_;
  double eps_;
  double momentum_;
  Parameter weight_;
  Parameter bias_;
  Tensor running_mean_;
  Tensor running_var_;
  Tensor num_batches_tracked_;  // int64 scalar, shape []

  // Cached by forward for backward.
  Tensor input_;
  Tensor mean_;    // batch (train) or running (eval) mean used to normalise
  Tensor invstd_;  // 1 / sqrt(var + eps) for that var
  int64_t count_ = 0;
  bool forward_was_training_ = false;
};

}  // namespace mtrain::models
