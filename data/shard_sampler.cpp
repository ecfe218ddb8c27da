#include "data/shard_sampler.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace mtrain::data {

ShardSampler::ShardSampler(std::vector<int64_t> shard_starts, int rank, int world_size, ShardSamplerOptions options)
    : starts_(std::move(shard_starts)), rank_(rank), world_size_(world_size), options_(options) {
  if (world_size_ < 1 || rank_ < 0 || rank_ >= world_size_) {
    throw InvalidArgument(fmt::format("ShardSampler: expected 0 <= rank < world_size, found rank {} of {}", rank_,
                                      world_size_));
  }
  if (options_.buffer < 1) {
    throw InvalidArgument(fmt::format("ShardSampler: expected a shuffle buffer of at least 1, found {}", options_.buffer));
  }
  if (starts_.empty() || starts_.front() != 0 || !std::is_sorted(starts_.begin(), starts_.end())) {
    throw InvalidArgument("ShardSampler: expected shard starts rising from 0");
  }
  int64_t nonempty = 0;
  for (int64_t k = 0; k + 1 < static_cast<int64_t>(starts_.size()); ++k) nonempty += shard_size(k) > 0 ? 1 : 0;
  if (nonempty < world_size_) {
    throw InvalidArgument(fmt::format(
        "{} shard(s) with samples for {} ranks: each rank reads shards of its own, so there must be at least one per "
        "rank; pack the data into more, smaller shards (mtrain-pack --shard-size)",
        nonempty, world_size_));
  }
}

// Note [Shards per rank]
// ~~~~~~~~~~~~~~~~~~~~~~
// WebDataset's rule, with DistributedSampler's guarantees where they can be kept:
// - Each epoch the shards are put in an order drawn from (seed + epoch), as DistributedSampler
//   draws its permutation, and dealt out one by one, each to the rank with the fewest samples
//   so far (ties to the lower rank). Ranks read disjoint shards, every shard once an epoch,
//   and their sample counts differ by at most one shard's size.
// - A rank reads its shards one after the other, each front to back, through a shuffle
//   buffer of `buffer` samples drawn from (seed, epoch, rank): a sample leaves the buffer at a
//   random slot and the next one read takes its place; at the end the buffer empties in a
//   random order. A sample is therefore read at most `buffer` samples before it is used, which
//   bounds what a reader holds, and the reads move forward through each shard.
// - The ranks must take equal steps, so every rank takes as many samples as the rank with
//   the most, repeating its own first samples (DistributedSampler pads the same way), or,
//   with drop_last, as many as the rank with the fewest, leaving its last ones out. Either
//   costs at most one shard's samples per rank an epoch, and a different shard each epoch.
std::vector<std::vector<int64_t>> ShardSampler::assignment() const {
  const auto shards = static_cast<int64_t>(starts_.size()) - 1;
  std::vector<int64_t> order(static_cast<size_t>(shards));
  if (options_.shuffle) {
    order = random_permutation(shards, options_.seed + static_cast<uint64_t>(epoch()));
  } else {
    for (int64_t k = 0; k < shards; ++k) order[static_cast<size_t>(k)] = k;
  }
  std::vector<std::vector<int64_t>> ranks(static_cast<size_t>(world_size_));
  std::vector<int64_t> load(static_cast<size_t>(world_size_), 0);
  for (const int64_t k : order) {
    if (shard_size(k) == 0) continue;
    const auto r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    ranks[r].push_back(k);
    load[r] += shard_size(k);
  }
  return ranks;
}

int64_t ShardSampler::size() const {
  std::vector<int64_t> load;
  for (const std::vector<int64_t>& shards : assignment()) {
    int64_t n = 0;
    for (const int64_t k : shards) n += shard_size(k);
    load.push_back(n);
  }
  return options_.drop_last ? *std::min_element(load.begin(), load.end()) : *std::max_element(load.begin(), load.end());
}

std::vector<int64_t> ShardSampler::indices() const {
  const std::vector<int64_t> mine = assignment()[static_cast<size_t>(rank_)];
  const int64_t wanted = size();
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(wanted));
  Rng rng(mix64(mix64(mix64(options_.seed ^ 0x53484152445Full) ^ static_cast<uint64_t>(epoch())) ^
                static_cast<uint64_t>(rank_)));
  std::vector<int64_t> buffer;
  for (const int64_t k : mine) {
    for (int64_t i = starts_[static_cast<size_t>(k)]; i < starts_[static_cast<size_t>(k) + 1]; ++i) {
      if (!options_.shuffle) {
        out.push_back(i);
      } else if (static_cast<int64_t>(buffer.size()) < options_.buffer) {
        buffer.push_back(i);
      } else {
        int64_t& slot = buffer[rng.uniform_below(buffer.size())];
        out.push_back(slot);
        slot = i;
      }
    }
  }
  while (!buffer.empty()) {
    const size_t slot = rng.uniform_below(buffer.size());
    out.push_back(buffer[slot]);
    buffer[slot] = buffer.back();
    buffer.pop_back();
  }
  if (static_cast<int64_t>(out.size()) > wanted) out.resize(static_cast<size_t>(wanted));
  for (size_t i = 0; static_cast<int64_t>(out.size()) < wanted; ++i) {
    const int64_t repeated = out[i];
    out.push_back(repeated);
  }
  return out;
}

std::string ShardSampler::describe() const {
  return fmt::format("rank {} of {} reads its own shards ({} of {} this epoch){}, {} samples a rank ({})", rank_,
                     world_size_, assignment()[static_cast<size_t>(rank_)].size(), starts_.size() - 1,
                     options_.shuffle ? fmt::format(" through a shuffle buffer of {} (seed {})", options_.buffer,
                                                    options_.seed)
                                      : " in order",
                     size(), options_.drop_last ? "the fewest any rank has" : "the most any rank has, padded");
}

}  // namespace mtrain::data
