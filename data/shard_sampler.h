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
  // shard_starts: shard k's items are [shard_starts[k], shard_starts[k + 1]) (ShardedImages'
  // shard_starts). Throws InvalidArgument unless the starts rise from 0, 0 <= rank < world_size,
  // buffer >= 1, and there are at least world_size shards with samples.
  ShardSampler(std::vector<int64_t> shard_starts, int rank, int world_size, ShardSamplerOptions options);

  std::vector<int64_t> indices() const override;
  int64_t size() const override;
  std::string describe() const override;

  // The shards (numbers into shard_starts) each rank reads in the current epoch, in reading
  // order: world_size lists, disjoint, together every shard with samples.
  std::vector<std::vector<int64_t>> assignment() const;

 private:
  std::vector<int64_t> starts_;
  int rank_;
  int world_size_;
  ShardSamplerOptions options_;

  int64_t shard_size(int64_t k) const { return starts_[static_cast<size_t>(k) + 1] - starts_[static_cast<size_t>(k)]; }
};

}  // namespace mtrain::data
