// SyncBatchNorm: BatchNorm2d whose training-mode statistics span every rank of a process group
// (torch.nn.SyncBatchNorm), and convert_sync_batchnorm, which swaps it in. Training forward
// all-gathers each rank's statistics and merges them identically on every rank (Note
// [SyncBatchNorm wire format], Note [SyncBatchNorm merge], both in sync_batchnorm.cpp); training
// backward all-reduces two per-channel sums; eval mode never communicates. A group of one equals
// BatchNorm2d bitwise. A global count of at most one value per channel, or a rank's count above
// 2^24, is InvalidArgument on every rank alike.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "collectives/process_group.h"
#include "models/batchnorm.h"

namespace mtrain::models {

class SyncBatchNorm : public BatchNorm2d {
 public:
  // `group` must be non-null; every rank of it must run the same sequence of training
  // forwards/backwards through its SyncBatchNorm layers (they are collectives).
  SyncBatchNorm(int64_t channels, std::shared_ptr<ProcessGroup> group, double eps = 1e-5,
                double momentum = 0.1);

  std::string type_name() const override { return "SyncBatchNorm"; }
  bool replayable() const override { return false; }  // collectives waited on by the host
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  // Seconds this rank has spent blocked in the layer's collectives (the forward
  // all-gather and the backward all-reduce) since construction: waiting for the other
  // ranks to reach the layer, plus the transfer. Host time; on a GPU too, where the
  // layer waits on the host for both collectives (an NCCL Work's wait() polls until the
  // operation has completed), so the host stalls twice per layer.
  double wait_seconds() const { return wait_seconds_; }

 protected:
  void merge_batch_stats(BatchStats& stats) override;
  void reduce_backward_sums(Tensor& sum_dy, Tensor& sum_dy_xmu) override;

 private:
  // Waits for `work`, adding the time to wait_seconds_.
  void timed_wait(Work& work);

  std::shared_ptr<ProcessGroup> group_;
  double wait_seconds_ = 0.0;
};

// The sum of wait_seconds() over the SyncBatchNorm layers of `root`'s subtree.
double sync_batchnorm_wait_seconds(Module& root);

// Replaces every BatchNorm2d strictly below `root` by a SyncBatchNorm with the same
// name, num_features, eps, momentum, weights, running statistics, num_batches_tracked,
// train/eval mode, fusion, input bias and layout (set_fused, set_input_bias,
// set_channels_last); existing SyncBatchNorms are kept. Returns how many were
// replaced. The new layers carry no grad-ready hook and unnumbered parameters: call
// root.set_grad_ready_hook again afterwards (Note [Grad-ready hook] in module.cpp).
// `root` itself cannot be swapped in place, so a BatchNorm2d root is InvalidArgument.
int convert_sync_batchnorm(Module& root, std::shared_ptr<ProcessGroup> group);

}  // namespace mtrain::models
