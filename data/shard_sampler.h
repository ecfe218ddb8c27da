// The training sampler of a streamed dataset: each rank reads its own shards, front to back,
// through a shuffle buffer (Note [Shards per rank] in shard_sampler.cpp). Follows the
// Sampler contract (sampler.h): a pure function of its configuration and the epoch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/random.h"
#include "data/sampler.h"

namespace mtrain::data {

struct ShardSamplerOptions {
  bool shuffle = true;          // shard order and the buffer's draws; else shards in order, samples in order
  uint64_t seed = 0;
  bool drop_last = false;       // every rank cut to the fewest samples instead of padded to the most
  int64_t buffer = 1000;        // the shuffle buffer's samples (>= 1)
};

class ShardSampler final : public Sampler {
 public:
  // shard_starts: shard k's items are [shard_starts[k], shard_starts[k + 1]) (EncodedImages'
  // shard_starts). Throws InvalidArgument unless the starts rise from 0, 0 <= rank < world_size,
  // buffer >= 1, and there are at least world_size shards with samples.
  ShardSampler(std::vector<int64_t> shard_starts, int rank, int world_size, ShardSamplerOptions options);

  std::vector<int64_t> indices() const override;
  int64_t size() const override;
  std::string describe() const override;

  // The shards (numbers into shard_starts) each rank reads in the current epoch, in reading
  // order: world_size lists, disjoint, together every shard with samples left.
  std::vector<std::vector<int64_t>> assignment() const;

  // A world that took part of an epoch: its ranks, and the items its ranks took together
  // (each rank the same share: its first consumed / world_size items).
  struct EarlierWorld {
    int world_size = 1;
    int64_t consumed = 0;
  };
  // Epoch `epoch` continues after `earlier`, oldest first (Note [An epoch of shards in
  // several worlds]): this world deals out and reads only the samples they left. Other
  // epochs are whole. InvalidArgument for a negative epoch, a world < 1, or a share that
  // does not divide by its world.
  void resume_epoch(int64_t epoch, std::vector<EarlierWorld> earlier);

 private:
  struct Deal {
    std::vector<std::vector<int64_t>> shards;  // per rank, in reading order
    std::vector<int64_t> loads;                // per rank: samples left in its shards
  };
  // One world's deal of what `taken` leaves (null: the whole epoch).
  Deal deal(int world, const std::vector<uint8_t>* taken) const;
  // Rank `rank`'s order in that deal, the `round`-th world of the epoch, cut or padded to
  // the world's equal share.
  std::vector<int64_t> order(int world, int rank, uint64_t round, const std::vector<uint8_t>* taken) const;
  const std::vector<uint8_t>* taken_now() const;  // this epoch's taken samples, or null

  std::vector<int64_t> starts_;
  int rank_;
  int world_size_;
  ShardSamplerOptions options_;
  int64_t resumed_epoch_ = -1;
  std::vector<EarlierWorld> earlier_;
  std::vector<uint8_t> taken_;  // resumed_epoch_'s samples the earlier worlds took

  int64_t shard_size(int64_t k) const { return starts_[static_cast<size_t>(k) + 1] - starts_[static_cast<size_t>(k)]; }
};

}  // namespace mtrain::data
