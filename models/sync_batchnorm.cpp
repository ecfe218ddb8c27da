#include "models/sync_batchnorm.h"

#include <chrono>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/trace.h"
#include "tensor/ops.h"

// Note [SyncBatchNorm wire format]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Forward (training): each rank packs its local BatchStats as 2C+1 float32 values,
//   [mean (C), biased var (C), count (1)],
// and one allgather gives every rank every rank's row, so each rank merges the same numbers in the
// same order and all replicas get bitwise identical global statistics. An allgather rather than an
// allreduce because the merge weights each rank by its own count (torch: "count could be different
// across ranks").
//
// torch sends invstd = 1/sqrt(var + eps) and recovers var = 1/invstd^2 - eps on the other side.
// We send the biased variance itself: the merge needs var, the BatchStats convention is var, and
// the round trip through invstd is not exact in float32 (for var much smaller than eps it cancels
// to a few correct bits). Same size on the wire, same merge, one rounding fewer.
//
// The count travels as a float so that one collective of one dtype carries the row (allgather
// needs equal numel and dtype on every rank). float32 holds integers exactly up to 2^24 =
// 16,777,216 values per channel per rank (e.g. batch 256 at 224x224 is 12.8M); a rank above that
// sends -1 instead, and every rank then raises the same InvalidArgument naming it, so no rank is
// left waiting in a later collective.
//
// Note [SyncBatchNorm merge]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// As torch's batch_norm_gather_stats_with_counts (Chan et al.'s pairwise update), in double, ranks
// in rank order, ranks with count 0 skipped (ops::batchnorm_merge_stats, on the device of the
// statistics; CPU and GPU kernels do the same operations in the same order, see Note [Batch-norm
// channel arithmetic] in tensor/cpu/batchnorm_channels.cpp):
//   n' = n + n_j;  M2 += var_j*n_j + (mean - mean_j)^2 * n*n_j/n';
//   mean = (n*mean + n_j*mean_j)/n';   global biased var = M2/n.
// With a single contributing rank this returns that rank's mean and var exactly (float times an
// integer below 2^24 is exact in double, and so is the division back), so a group of one equals
// BatchNorm2d bitwise. The base class then updates the running statistics with the unbiased global
// variance var*N/(N-1) and normalises backward by the global count N. A global N <= 1 is an
// InvalidArgument on every rank alike (every rank sees the same N). A rank with an empty local
// batch sends zeros with count 0 and still joins both collectives, so its peers are not blocked.
//
// Backward: one allreduce(SUM) of cat[sum_dy, sum_dy_xmu] (2C floats). Weight and bias gradients
// stay local (the base class computes them before this step); the DDP reducer sums them like any
// other gradient. Eval mode never communicates.

namespace mtrain::models {

namespace {

// Largest per-rank count a float32 carries exactly (Note [SyncBatchNorm wire format]).
constexpr int64_t kMaxExactCount = int64_t{1} << 24;
// Sent in the count slot by a rank whose count exceeds kMaxExactCount.
constexpr float kCountTooLarge = -1.0f;

}  // namespace

SyncBatchNorm::SyncBatchNorm(int64_t channels, std::shared_ptr<ProcessGroup> group, double eps,
                             double momentum)
    : BatchNorm2d(channels, eps, momentum), group_(std::move(group)) {
  if (!group_) {
    throw InvalidArgument(fmt::format("{}: expected a process group, found none", description()));
  }
}

void SyncBatchNorm::timed_wait(Work& work) {
  const auto start = std::chrono::steady_clock::now();
  work.wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void SyncBatchNorm::merge_batch_stats(BatchStats& stats) {
  const int64_t c = num_features();
  const int world = group_->size();
  const int64_t row = 2 * c + 1;
  // Every tensor the collectives see lives on the input's device (NCCL needs device
  // memory; the host backends stage device tensors themselves).
  const Device device = stats.mean.device();

  Tensor local = Tensor::empty({row}, DType::Float32, device);
  local.flat_view(0, {c}).copy_(stats.mean);
  local.flat_view(c, {c}).copy_(stats.var);
  local.flat_view(2 * c, {1})
      .fill_(stats.count > kMaxExactCount ? kCountTooLarge : static_cast<float>(stats.count));

  Tensor all = Tensor::empty({world, row}, DType::Float32, device);
  Tensor all_flat = all.view({world * row});
  {
    const trace::Span span("SyncBatchNorm all-gather", "comm", "channels", c);
    timed_wait(*group_->allgather(local, all_flat));
  }

  // The checks below need every rank's count on the host. On a GPU that is one small
  // device-to-host copy of the gathered rows per layer per training forward, which
  // synchronises the stream once there; the merge itself stays on the device. (Copying
  // only the count column would save bytes, not the synchronisation.)
  const Tensor host_rows = all.to(Device::cpu());
  const float* rows = host_rows.data<float>();
  for (int r = 0; r < world; ++r) {
    if (rows[r * row + 2 * c] == kCountTooLarge) {
      throw InvalidArgument(fmt::format(
          "{}: rank {} has more than 2^24 = {} values per channel in its local batch, more "
          "than the float32 count of the statistics all-gather carries exactly; use a smaller "
          "per-rank batch or resolution",
          description(), r, kMaxExactCount));
    }
  }
  int64_t total = 0;
  for (int r = 0; r < world; ++r) total += static_cast<int64_t>(rows[r * row + 2 * c]);
  if (total <= 1) {
    throw InvalidArgument(fmt::format(
        "{}: expected more than 1 value per channel when training, got global batch of {} "
        "across {} ranks (this rank's count: {})",
        description(), total, world, stats.count));
  }

  // Note [SyncBatchNorm merge]; stats.mean and stats.var are this layer's own tensors,
  // so they can take the result.
  ops::batchnorm_merge_stats(all, stats.mean, stats.var);
  stats.count = total;
}

void SyncBatchNorm::reduce_backward_sums(Tensor& sum_dy, Tensor& sum_dy_xmu) {
  const int64_t c = num_features();
  Tensor sums = Tensor::empty({2 * c}, DType::Float32, sum_dy.device());
  sums.flat_view(0, {c}).copy_(sum_dy);
  sums.flat_view(c, {c}).copy_(sum_dy_xmu);
  {
    const trace::Span span("SyncBatchNorm all-reduce", "comm", "channels", c);
    timed_wait(*group_->allreduce(sums, ReduceOp::Sum));
  }
  sum_dy.copy_(sums.flat_view(0, {c}));
  sum_dy_xmu.copy_(sums.flat_view(c, {c}));
}

double sync_batchnorm_wait_seconds(Module& root) {
  double total = 0.0;
  for (const auto& [name, module] : root.named_modules()) {
    if (const auto* sync = dynamic_cast<const SyncBatchNorm*>(module)) total += sync->wait_seconds();
  }
  return total;
}

int convert_sync_batchnorm(Module& root, std::shared_ptr<ProcessGroup> group) {
  if (!group) {
    throw InvalidArgument("convert_sync_batchnorm: expected a process group, found none");
  }
  if (dynamic_cast<BatchNorm2d*>(&root) != nullptr &&
      dynamic_cast<SyncBatchNorm*>(&root) == nullptr) {
    throw InvalidArgument(
        "convert_sync_batchnorm: the root module is itself a BatchNorm2d, which cannot be "
        "replaced in place; pass the model that contains it");
  }
  return replace_modules(root, [&](Module& module) -> std::unique_ptr<Module> {
    auto* bn = dynamic_cast<BatchNorm2d*>(&module);
    if (bn == nullptr || dynamic_cast<SyncBatchNorm*>(bn) != nullptr) return nullptr;
    auto sync =
        std::make_unique<SyncBatchNorm>(bn->num_features(), group, bn->eps(), bn->momentum());
    // Beside the layer it replaces: a model already moved with to() stays on its device.
    sync->to(bn->weight().value.device());
    sync->copy_state_from(*bn);
    sync->set_fused(bn->fused(), bn->fused_relu());
    sync->set_input_bias(bn->input_bias());
    sync->set_channels_last(bn->channels_last());
    sync->train(bn->is_training());
    return sync;
  });
}

}  // namespace mtrain::models
