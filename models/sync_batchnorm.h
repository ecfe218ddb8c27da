// SyncBatchNorm: BatchNorm2d whose training-mode statistics span every rank of a
// process group (torch.nn.SyncBatchNorm), and convert_sync_batchnorm, which swaps it in.
//
// Note [SyncBatchNorm wire format]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Forward (training): each rank packs its local BatchStats as 2C+1 float32 values,
//   [mean (C), biased var (C), count (1)],
// and one allgather gives every rank every rank's row, so each rank merges the same
// numbers in the same order and all replicas get bitwise identical global statistics.
// An allgather rather than an allreduce because the merge weights each rank by its own
// count (torch: "count could be different across ranks").
//
// torch sends invstd = 1/sqrt(var + eps) and recovers var = 1/invstd^2 - eps on the
// other side. We send the biased variance itself: the merge needs var, the BatchStats
// convention is var, and the round trip through invstd is not exact in float32 (for
// var much smaller than eps it cancels to a few correct bits). Same size on the wire,
// same merge, one rounding fewer.
//
// The count travels as a float so that one collective of one dtype carries the row
// (allgather needs equal numel and dtype on every rank). float32 holds integers exactly
// up to 2^24 = 16,777,216 values per channel per rank (e.g. batch 256 at 224x224 is
// 12.8M); a rank above that sends -1 instead, and every rank then raises the same
// InvalidArgument naming it, so no rank is left waiting in a later collective.
//
// Note [SyncBatchNorm merge]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// As torch's batch_norm_gather_stats_with_counts (Chan et al.'s pairwise update), in
// double, ranks in rank order, ranks with count 0 skipped (ops::batchnorm_merge_stats,
// on the device of the statistics; CPU and GPU kernels do the same operations in the
// same order, see Note [Batch-norm channel arithmetic] in tensor/cpu/batchnorm_channels.cpp):
//   n' = n + n_j;  M2 += var_j*n_j + (mean - mean_j)^2 * n*n_j/n';
//   mean = (n*mean + n_j*mean_j)/n';   global biased var = M2/n.
// With a single contributing rank this returns that rank's mean and var exactly (float
// times an integer below 2^24 is exact in double, and so is the division back), so a
// group of one equals BatchNorm2d bitwise. The base class then updates the running
// statistics with the unbiased global variance var*N/(N-1) and normalises backward by
// the global count N. A global N <= 1 is an InvalidArgument on every rank alike (every
// rank sees the same N). A rank with an empty local batch sends zeros with count 0 and
// still joins both collectives, so its peers are not blocked.
//
// Backward: one allreduce(SUM) of cat[sum_dy, sum_dy_xmu] (2C floats). Weight and bias
// gradients stay local (the base class computes them before this step); the DDP
// reducer sums them like any other gradient. Eval mode never communicates.
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
// name, num_features, eps, momentum, weights, running statistics, num_batches_tracked
// and train/eval mode; existing SyncBatchNorms are kept. Returns how many were
// replaced. The new layers carry no grad-ready hook and unnumbered parameters: call
// root.set_grad_ready_hook again afterwards (Note [Grad-ready hook] in module.h).
// `root` itself cannot be swapped in place, so a BatchNorm2d root is InvalidArgument.
int convert_sync_batchnorm(Module& root, std::shared_ptr<ProcessGroup> group);

}  // namespace mtrain::models
