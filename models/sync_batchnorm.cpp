#include "models/sync_batchnorm.h"

#include <utility>
#include <vector>

#include "core/error.h"

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

void SyncBatchNorm::merge_batch_stats(BatchStats& stats) {
  const int64_t c = num_features();
  const int world = group_->size();
  const int64_t row = 2 * c + 1;

  Tensor local = Tensor::empty({row});
  float* out = local.data<float>();
  const float* mean = stats.mean.data<float>();
  const float* var = stats.var.data<float>();
  for (int64_t i = 0; i < c; ++i) {
    out[i] = mean[i];
    out[c + i] = var[i];
  }
  out[2 * c] = stats.count > kMaxExactCount ? kCountTooLarge : static_cast<float>(stats.count);

  Tensor all = Tensor::empty({world * row});
  group_->allgather(local, all)->wait();

  // Note [SyncBatchNorm merge].
  const float* rows = all.data<float>();
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

  float* merged_mean = stats.mean.data<float>();
  float* merged_var = stats.var.data<float>();
  for (int64_t i = 0; i < c; ++i) {
    double n = 0.0, avg = 0.0, m2 = 0.0;
    for (int r = 0; r < world; ++r) {
      const float* rank_row = rows + r * row;
      const double n_j = rank_row[2 * c];
      if (n_j <= 0.0) continue;
      const double mean_j = rank_row[i];
      const double var_j = rank_row[c + i];
      const double n_new = n + n_j;
      const double delta = avg - mean_j;
      m2 += var_j * n_j + delta * delta * n * n_j / n_new;
      avg = (n * avg + n_j * mean_j) / n_new;
      n = n_new;
    }
    merged_mean[i] = static_cast<float>(avg);
    merged_var[i] = static_cast<float>(m2 / n);
  }
  stats.count = total;
}

void SyncBatchNorm::reduce_backward_sums(Tensor& sum_dy, Tensor& sum_dy_xmu) {
  const int64_t c = num_features();
  Tensor sums = Tensor::empty({2 * c});
  sums.flat_view(0, {c}).copy_(sum_dy);
  sums.flat_view(c, {c}).copy_(sum_dy_xmu);
  group_->allreduce(sums, ReduceOp::Sum)->wait();
  sum_dy.copy_(sums.flat_view(0, {c}));
  sum_dy_xmu.copy_(sums.flat_view(c, {c}));
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
    sync->copy_state_from(*bn);
    sync->train(bn->is_training());
    return sync;
  });
}

}  // namespace mtrain::models
