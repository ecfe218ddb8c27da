// Rank-aware samplers: each rank of a data-parallel job visits its own shard of the dataset, and
// the shards are derived from one global order that every rank computes alone
// (permutation(kind, n, seed + epoch), data/random.h), so no communication is needed to agree
// on them. Training shards give every rank the same number of steps, which keeps the ranks'
// collectives in lock step (Note [DistributedSampler semantics], Note [Global batch sharding],
// both in distributed_sampler.cpp). Each follows the Sampler contract (sampler.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "data/random.h"
#include "data/sampler.h"

namespace mtrain::data {

// Training shards with PyTorch's DistributedSampler semantics (Note [DistributedSampler
// semantics]): every rank gets ceil(N / W) items (floor with drop_last), interleaved from the
// epoch's order, padded by repeating it without drop_last.
class DistributedSampler final : public Sampler {
 public:
  // Throws InvalidArgument unless dataset_size >= 0, world_size >= 1, 0 <= rank < world_size.
  // `permutation` is the shuffled order's generator: mtrain's, or torch.randperm's.
  DistributedSampler(int64_t dataset_size, int rank, int world_size, bool shuffle, uint64_t seed,
                     bool drop_last, Permutation permutation = Permutation::kMtrain);

  std::vector<int64_t> indices() const override;
  int64_t size() const override;  // num_samples (the rest's share in a resumed epoch)
  std::string describe() const override;

  int64_t total_size() const { return num_samples_ * world_size_; }

  // Epoch `epoch` resumes where a run with another world size stopped (Note [The rest of an
  // epoch in another world]): the first `consumed` items of the epoch's order were trained
  // on, and this world's shards split the rest of it, padded or truncated for this world as
  // a whole epoch would be. Other epochs are unchanged. Throws InvalidArgument for a
  // negative `consumed` or epoch.
  void resume_epoch(int64_t epoch, int64_t consumed);

 private:
  int64_t dataset_size_;
  int rank_;
  int world_size_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  Permutation permutation_;
  int64_t num_samples_;
  int64_t resumed_epoch_ = -1;  // resume_epoch's epoch; -1: none
  int64_t consumed_ = 0;

  // Items of the epoch's order this epoch visits from (consumed_ in the resumed epoch, else 0),
  // and how many each rank takes of what follows.
  int64_t first_item() const;
  int64_t samples_of(int64_t rest) const;
};

// Evaluation shards: rank r visits r, r + W, r + 2W, ... < N in order, without padding,
// so over all ranks every index is visited exactly once and metrics summed across ranks
// count every sample once. Ranks may differ by one item; an evaluation loop that
// all-reduces only after its last batch does not need equal step counts.
class EvalShardSampler final : public Sampler {
 public:
  // Throws InvalidArgument unless dataset_size >= 0, world_size >= 1, 0 <= rank < world_size.
  EvalShardSampler(int64_t dataset_size, int rank, int world_size);

  std::vector<int64_t> indices() const override;
  int64_t size() const override;
  std::string describe() const override;

 private:
  int64_t dataset_size_;
  int rank_;
  int world_size_;
};

// Per-rank sizes of a global batch, torch.chunk-like: ceil(G/W) for each rank until G
// runs out, then 0 (30 on 4 -> 8,8,8,6; 25 on 4 -> 7,7,7,4; 2 on 4 -> 1,1,0,0). Always
// world_size entries summing to global_batch. Throws InvalidArgument unless
// global_batch >= 1 and world_size >= 1.
std::vector<int64_t> split_global_batch(int64_t global_batch, int world_size);

// Splits `total` items in proportion to `weights` (one per rank, each >= 0, at least one
// > 0) by largest remainders, ties to the lower rank; every rank with a positive weight gets
// at least `minimum` when total >= minimum * (ranks with a positive weight), and a rank with
// weight 0 gets nothing. Integer arithmetic only, so every rank computes the same split
// (Note [Shares by integer arithmetic]). Throws InvalidArgument for bad arguments.
std::vector<int64_t> apportion(int64_t total, const std::vector<int64_t>& weights, int64_t minimum);

// This rank's share of every global batch (--global-batch-size; Note [Global batch
// sharding]): concatenating the ranks' chunks of step s in rank order gives exactly the
// single-process batch s. A rank's chunk may be empty; it still takes the step. The chunks
// follow torch.chunk unless set_shares gives them (--balance; Note [Shares that change
// mid-epoch]).
class GlobalBatchShardSampler final : public Sampler {
 public:
  // Throws InvalidArgument unless dataset_size >= 0, world_size >= 1,
  // 0 <= rank < world_size and global_batch >= 1.
  GlobalBatchShardSampler(int64_t dataset_size, int rank, int world_size, int64_t global_batch,
                          bool shuffle, uint64_t seed, bool drop_last,
                          Permutation permutation = Permutation::kMtrain);

  // The concatenation of this rank's chunks, step by step.
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return size_; }
  std::string describe() const override;
  // Starts `epoch` with the latest shares from its first step.
  void set_epoch(int64_t epoch) override;

  // This rank's batch size at each step (0 where its chunk is empty); the same number of
  // steps on every rank, summing to size().
  std::vector<int64_t> batch_sizes() const override { return batch_sizes_; }
  int64_t steps() const { return static_cast<int64_t>(batch_sizes_.size()); }

  // Every rank's chunk of step `step` of the current epoch, in rank order.
  std::vector<int64_t> chunks(int64_t step) const;
  // The images every rank's chunks of step `step` hold together: the global batch, or what
  // the epoch has left at a partial last step; the same whatever the shares.
  int64_t step_size(int64_t step) const;
  // Full global batches from step `from_step` of the current epoch on, and all of later
  // epochs, are split by `shares` (world_size entries >= 0 summing to the global batch);
  // a partial last batch in proportion to them (apportion, at least 1 per rank with a
  // share). Steps before `from_step` keep their split. Throws InvalidArgument for shares
  // of another length or sum, or a negative step.
  void set_shares(int64_t from_step, std::vector<int64_t> shares);
  // The shares of the latest set_shares; torch.chunk's split before any.
  std::vector<int64_t> shares() const;

 private:
  int64_t dataset_size_;
  int rank_;
  int world_size_;
  int64_t global_batch_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  Permutation permutation_;
  // (first step, shares) in increasing first step; empty: torch.chunk's split.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> share_plan_;
  std::vector<int64_t> batch_sizes_;
  int64_t size_ = 0;

  void plan_batches();  // batch_sizes_ and size_ from the share plan
};

}  // namespace mtrain::data
