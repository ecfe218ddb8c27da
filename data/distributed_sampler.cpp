#include "data/distributed_sampler.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/error.h"
#include "data/random.h"

namespace mtrain::data {
namespace {

void check_shard_arguments(const char* sampler, int64_t dataset_size, int rank, int world_size) {
  if (dataset_size < 0) {
    throw InvalidArgument(
        fmt::format("{}: expected a dataset size >= 0, found {}", sampler, dataset_size));
  }
  if (world_size < 1) {
    throw InvalidArgument(
        fmt::format("{}: expected a world size >= 1, found {}", sampler, world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw InvalidArgument(fmt::format("{}: expected a rank in [0, {}) for world size {}, found {}",
                                      sampler, world_size, world_size, rank));
  }
}

// The order every rank derives the same way for an epoch.
std::vector<int64_t> global_order(int64_t n, bool shuffle, uint64_t seed, Permutation kind, int64_t epoch) {
  if (shuffle) return permutation(kind, n, seed + static_cast<uint64_t>(epoch));
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  return order;
}

std::string order_description(bool shuffle, uint64_t seed, Permutation kind) {
  if (!shuffle) return "in order";
  return fmt::format("shuffled ({}seed {} + epoch)", kind == Permutation::kTorch ? "torch.randperm's order, " : "",
                     seed);
}

}  // namespace

// Note [DistributedSampler semantics]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// DistributedSampler follows torch.utils.data.DistributedSampler exactly, with N = dataset size,
// W = world size, r = rank:
//
//   num_samples = drop_last && N % W != 0 ? ceil((N - W) / W)   (= floor(N / W))
//                                         : ceil(N / W)
//   total       = num_samples * W
//   order       = shuffle ? permutation(kind, N, seed + epoch) : 0, 1, ..., N-1
//   not drop_last: order += order[:total - N], repeating the whole list as often as needed
//                  when total - N > N (N = 2, W = 5: order a b -> a b a b a)
//   drop_last:     order = order[:total]             (the tail is never visited)
//   rank r gets    order[r : total : W]               (interleaved, num_samples items)
//
// So every rank gets the same count, which keeps the ranks' step counts, and hence their
// collectives, in lock step. The price without drop_last is that total - N samples are visited
// twice per epoch. That is harmless for training but skews evaluation metrics
// (pytorch/pytorch#25162), which is why evaluation uses EvalShardSampler instead. The permutation
// is mtrain's own (Note [Portable randomness]) unless Permutation::kTorch asks for torch.randperm's
// (Note [torch.randperm's order]); with it, every rank's shard is PyTorch's, index for index.
DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int world_size,
                                       bool shuffle, uint64_t seed, bool drop_last, Permutation permutation)
    : dataset_size_(dataset_size),
      rank_(rank),
      world_size_(world_size),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last),
      permutation_(permutation),
      num_samples_(0) {
  check_shard_arguments("DistributedSampler", dataset_size, rank, world_size);
  num_samples_ = samples_of(dataset_size);
}

int64_t DistributedSampler::samples_of(int64_t rest) const {
  const int64_t w = world_size_;
  // PyTorch writes the drop_last case as ceil((N - W) / W), which equals floor(N / W)
  // (also for N < W, where both are 0).
  return drop_last_ && rest % w != 0 ? rest / w : (rest + w - 1) / w;
}

// Note [The rest of an epoch in another world]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// After s optimizer steps of b images per rank on W ranks, the ranks together have visited
// positions [0, s * b * W) of the epoch's padded order: rank r took r, r + W, r + 2W, ...,
// so the union of every rank's first s * b is a prefix. A run resumed on W' ranks therefore
// continues with order[consumed:], the items not yet visited, and shards that rest as
// DistributedSampler shards a whole epoch: interleaved over W', padded by repeating the
// rest's head (or, with drop_last, truncated) so every rank takes the same number of
// steps. Every item of the epoch is visited once, save the padding a sharded epoch always
// has. A consumed prefix of N or more (the old world's padding included) leaves no rest.
void DistributedSampler::resume_epoch(int64_t epoch, int64_t consumed) {
  if (epoch < 0 || consumed < 0) {
    throw InvalidArgument(fmt::format("DistributedSampler::resume_epoch: expected an epoch and a count >= 0, found "
                                      "epoch {} and {} consumed", epoch, consumed));
  }
  resumed_epoch_ = epoch;
  consumed_ = consumed;
}

int64_t DistributedSampler::first_item() const {
  return epoch() == resumed_epoch_ ? std::min(consumed_, dataset_size_) : 0;
}

int64_t DistributedSampler::size() const {
  return epoch() == resumed_epoch_ ? samples_of(dataset_size_ - first_item()) : num_samples_;
}

std::vector<int64_t> DistributedSampler::indices() const {
  const std::vector<int64_t> order = global_order(dataset_size_, shuffle_, seed_, permutation_, epoch());
  const int64_t first = first_item();
  const int64_t rest = dataset_size_ - first;
  const int64_t samples = size();
  std::vector<int64_t> shard;
  shard.reserve(static_cast<size_t>(samples));
  // Position p of the padded (or truncated) list holds order[first + p % rest]: padding
  // appends the rest's head, wrapping around as often as needed, and with drop_last every
  // p < total <= rest. samples > 0 implies rest > 0.
  for (int64_t i = 0; i < samples; ++i) {
    const int64_t p = rank_ + i * world_size_;
    shard.push_back(order[static_cast<size_t>(first + p % rest)]);
  }
  return shard;
}

std::string DistributedSampler::describe() const {
  const int64_t total = total_size();
  const std::string adjustment =
      total > dataset_size_   ? fmt::format(", {} padded by repetition", total - dataset_size_)
      : total < dataset_size_ ? fmt::format(", last {} dropped", dataset_size_ - total)
                              : std::string();
  const std::string resumed =
      resumed_epoch_ >= 0 ? fmt::format("; epoch {} resumes after its first {} items", resumed_epoch_ + 1, consumed_)
                          : std::string();
  return fmt::format("distributed shard {} of {}: {} of {} items {}{}{}", rank_, world_size_,
                     num_samples_, dataset_size_, order_description(shuffle_, seed_, permutation_), adjustment,
                     resumed);
}

EvalShardSampler::EvalShardSampler(int64_t dataset_size, int rank, int world_size)
    : dataset_size_(dataset_size), rank_(rank), world_size_(world_size) {
  check_shard_arguments("EvalShardSampler", dataset_size, rank, world_size);
}

int64_t EvalShardSampler::size() const {
  return dataset_size_ > rank_ ? (dataset_size_ - rank_ + world_size_ - 1) / world_size_ : 0;
}

std::vector<int64_t> EvalShardSampler::indices() const {
  std::vector<int64_t> shard;
  shard.reserve(static_cast<size_t>(size()));
  for (int64_t i = rank_; i < dataset_size_; i += world_size_) shard.push_back(i);
  return shard;
}

std::string EvalShardSampler::describe() const {
  return fmt::format("evaluation shard {} of {}: {} of {} items in order, unpadded", rank_,
                     world_size_, size(), dataset_size_);
}

std::vector<int64_t> split_global_batch(int64_t global_batch, int world_size) {
  if (global_batch < 1) {
    throw InvalidArgument(
        fmt::format("split_global_batch: expected a global batch >= 1, found {}", global_batch));
  }
  if (world_size < 1) {
    throw InvalidArgument(
        fmt::format("split_global_batch: expected a world size >= 1, found {}", world_size));
  }
  const int64_t chunk = (global_batch + world_size - 1) / world_size;
  std::vector<int64_t> sizes(static_cast<size_t>(world_size));
  int64_t left = global_batch;
  for (int64_t& s : sizes) {
    s = std::min(chunk, left);
    left -= s;
  }
  return sizes;
}

// Note [Shares by integer arithmetic]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every rank computes the split of a global batch on its own, from the same inputs, and the
// ranks' chunks must tile the batch exactly: one rank that rounded 85.5 up while another rounded
// it down would skip an image or read one twice. So the split uses integers only (products in
// 128 bits): floor(total * w_r / sum w) per rank, then the items left over one each to the largest
// remainders, ties to the lower rank. A rank whose proportion falls below `minimum` is raised to
// it and the rest re-split among the others, until no rank is below (each round fixes at least one
// rank, and one always stays free: the largest proportion is at least the average).
std::vector<int64_t> apportion(int64_t total, const std::vector<int64_t>& weights, int64_t minimum) {
  if (total < 0 || minimum < 0 || weights.empty()) {
    throw InvalidArgument(fmt::format("apportion: expected total >= 0, minimum >= 0 and at least one weight, "
                                      "found total {}, minimum {}, {} weights",
                                      total, minimum, weights.size()));
  }
  const size_t n = weights.size();
  std::vector<bool> fixed(n, false);
  std::vector<int64_t> out(n, 0);
  int64_t positive = 0;
  for (size_t r = 0; r < n; ++r) {
    if (weights[r] < 0) {
      throw InvalidArgument(fmt::format("apportion: expected weights >= 0, found {} for rank {}", weights[r], r));
    }
    if (weights[r] == 0) fixed[r] = true;
    positive += weights[r] > 0 ? 1 : 0;
  }
  if (positive == 0) throw InvalidArgument("apportion: expected at least one weight > 0, found none");
  if (minimum > total / positive) minimum = 0;  // too few items for the minimum
  for (;;) {
    int64_t left = total;
    __int128 weight_sum = 0;
    for (size_t r = 0; r < n; ++r) {
      if (fixed[r]) {
        left -= out[r];
      } else {
        weight_sum += weights[r];
      }
    }
    std::vector<__int128> remainder(n, -1);
    std::vector<size_t> free_ranks;
    int64_t given = 0;
    for (size_t r = 0; r < n; ++r) {
      if (fixed[r]) continue;
      const __int128 q = static_cast<__int128>(left) * weights[r];
      out[r] = static_cast<int64_t>(q / weight_sum);
      remainder[r] = q % weight_sum;
      given += out[r];
      free_ranks.push_back(r);
    }
    std::stable_sort(free_ranks.begin(), free_ranks.end(),
                     [&](size_t a, size_t b) { return remainder[a] > remainder[b]; });
    for (int64_t k = 0; k < left - given; ++k) ++out[free_ranks[static_cast<size_t>(k)]];
    bool raised = false;
    for (size_t r : free_ranks) {
      if (out[r] < minimum) {
        out[r] = minimum;
        fixed[r] = true;
        raised = true;
      }
    }
    if (!raised) return out;
  }
}

// Note [Global batch sharding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With --global-batch-size G, a step processes exactly the G samples a single process would,
// split over the ranks. All ranks walk the same global order in global batches of G; batch s is
// order[s*G : (s+1)*G] and rank r takes chunk r of it, sized by split_global_batch (torch.chunk-
// like: ceil(G/W) per rank until G runs out). The last partial global batch is dropped with
// drop_last, else split the same way by its own size. Chunks are contiguous, so concatenating the
// ranks' chunks of step s in rank order gives exactly the single-process batch s. A rank's chunk
// may be empty whenever torch.chunk runs out before the last rank (G < W; G = 5 on W = 4 gives 2,
// 2, 1, 0 at every step; a small last batch); it still takes the step with a 0-row batch so the
// collectives match, which is why batch_sizes() lists every step and the DataLoader is driven with
// it (the loader reads batch_sizes() from the sampler).
GlobalBatchShardSampler::GlobalBatchShardSampler(int64_t dataset_size, int rank, int world_size,
                                                 int64_t global_batch, bool shuffle,
                                                 uint64_t seed, bool drop_last, Permutation permutation)
    : dataset_size_(dataset_size),
      rank_(rank),
      world_size_(world_size),
      global_batch_(global_batch),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last),
      permutation_(permutation) {
  check_shard_arguments("GlobalBatchShardSampler", dataset_size, rank, world_size);
  if (global_batch < 1) {
    throw InvalidArgument(fmt::format(
        "GlobalBatchShardSampler: expected a global batch size >= 1, found {}", global_batch));
  }
  plan_batches();
}

// Note [Shares that change mid-epoch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// --balance changes how a global batch is split between the ranks, also within an epoch. Global
// batch s is order[s*G : (s+1)*G] whatever the split, so changing the shares from step k on moves
// only the boundaries between the ranks' chunks of the steps from k on: every image of the epoch
// is still read once, each step still reads exactly the G images of the single-process batch s.
// The plan is a list of (first step, shares) within the current epoch; set_epoch keeps only the
// latest shares, from step 0. A partial last batch of m < G images is split in proportion to the
// shares (apportion), at least one image per rank that has a share when the batch has that many
// images (start_up's check refuses --sync-bn where a split leaves a rank without). Without set_shares the split is torch.chunk's,
// as before --balance existed.
void GlobalBatchShardSampler::plan_batches() {
  batch_sizes_.clear();
  size_ = 0;
  for (int64_t start = 0; start < dataset_size_; start += global_batch_) {
    const int64_t step_size = std::min(global_batch_, dataset_size_ - start);
    if (step_size < global_batch_ && drop_last_) break;
    batch_sizes_.push_back(0);  // so that chunks() sees the step
    batch_sizes_.back() = chunks(steps() - 1)[static_cast<size_t>(rank_)];
    size_ += batch_sizes_.back();
  }
}

int64_t GlobalBatchShardSampler::step_size(int64_t step) const {
  MTRAIN_CHECK(step >= 0 && step < steps(), "step {} of an epoch of {} steps", step, steps());
  return std::min(global_batch_, dataset_size_ - step * global_batch_);
}

std::vector<int64_t> GlobalBatchShardSampler::chunks(int64_t step) const {
  const int64_t images = step_size(step);
  const std::vector<int64_t>* shares = nullptr;
  for (const auto& [first, s] : share_plan_) {
    if (first <= step) shares = &s;
  }
  if (shares == nullptr) return split_global_batch(images, world_size_);
  if (images == global_batch_) return *shares;
  return apportion(images, *shares, 1);
}

void GlobalBatchShardSampler::set_shares(int64_t from_step, std::vector<int64_t> shares) {
  int64_t sum = 0;
  for (int64_t s : shares) {
    if (s < 0) throw InvalidArgument(fmt::format("shares of a global batch: expected each >= 0, found {}", s));
    sum += s;
  }
  if (static_cast<int>(shares.size()) != world_size_ || sum != global_batch_ || from_step < 0) {
    throw InvalidArgument(fmt::format(
        "shares of a global batch: expected {} shares summing to {} from a step >= 0, found {} summing to {} from "
        "step {}",
        world_size_, global_batch_, shares.size(), sum, from_step));
  }
  while (!share_plan_.empty() && share_plan_.back().first >= from_step) share_plan_.pop_back();
  share_plan_.emplace_back(from_step, std::move(shares));
  plan_batches();
}

std::vector<int64_t> GlobalBatchShardSampler::shares() const {
  if (share_plan_.empty()) return split_global_batch(global_batch_, world_size_);
  return share_plan_.back().second;
}

void GlobalBatchShardSampler::set_epoch(int64_t epoch) {
  Sampler::set_epoch(epoch);
  if (share_plan_.size() > 1 || (!share_plan_.empty() && share_plan_.back().first != 0)) {
    std::vector<int64_t> latest = share_plan_.back().second;
    share_plan_ = {{0, std::move(latest)}};
    plan_batches();
  }
}

std::vector<int64_t> GlobalBatchShardSampler::indices() const {
  const std::vector<int64_t> order = global_order(dataset_size_, shuffle_, seed_, permutation_, epoch());
  std::vector<int64_t> shard;
  shard.reserve(static_cast<size_t>(size_));
  for (int64_t step = 0; step < steps(); ++step) {
    const std::vector<int64_t> c = chunks(step);
    int64_t offset = step * global_batch_;
    for (int r = 0; r < rank_; ++r) offset += c[static_cast<size_t>(r)];
    const auto first = order.begin() + offset;
    shard.insert(shard.end(), first, first + c[static_cast<size_t>(rank_)]);
  }
  return shard;
}

std::string GlobalBatchShardSampler::describe() const {
  const std::string split =
      share_plan_.empty() ? std::string() : fmt::format(", shares {}", fmt::join(shares(), ","));
  return fmt::format(
      "global batch {} shard {} of {}: {} of {} items in {} steps {}{}{}", global_batch_, rank_,
      world_size_, size_, dataset_size_, batch_sizes_.size(), order_description(shuffle_, seed_, permutation_),
      drop_last_ && dataset_size_ % global_batch_ != 0 ? ", last partial global batch dropped" : "", split);
}

}  // namespace mtrain::data
