#include "data/shard_sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

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
// - An epoch's rest (a resume in another world) may lie in fewer shards than there are
//   ranks; then the ranks take turns over all of it instead, as DistributedSampler does.
ShardSampler::Deal ShardSampler::deal(int world, const std::vector<uint8_t>* taken) const {
  const auto shards = static_cast<int64_t>(starts_.size()) - 1;
  std::vector<int64_t> shard_order(static_cast<size_t>(shards));
  if (options_.shuffle) {
    shard_order = random_permutation(shards, options_.seed + static_cast<uint64_t>(epoch()));
  } else {
    for (int64_t k = 0; k < shards; ++k) shard_order[static_cast<size_t>(k)] = k;
  }
  Deal d{std::vector<std::vector<int64_t>>(static_cast<size_t>(world)), std::vector<int64_t>(static_cast<size_t>(world), 0)};
  for (const int64_t k : shard_order) {
    int64_t left = shard_size(k);
    if (taken != nullptr) {
      for (int64_t i = starts_[static_cast<size_t>(k)]; i < starts_[static_cast<size_t>(k) + 1]; ++i) left -= (*taken)[static_cast<size_t>(i)];
    }
    if (left == 0) continue;
    const auto r = static_cast<size_t>(std::min_element(d.loads.begin(), d.loads.end()) - d.loads.begin());
    d.shards[r].push_back(k);
    d.loads[r] += left;
  }
  return d;
}

std::vector<std::vector<int64_t>> ShardSampler::assignment() const { return deal(world_size_, taken_now()).shards; }

const std::vector<uint8_t>* ShardSampler::taken_now() const {
  return epoch() == resumed_epoch_ ? &taken_ : nullptr;
}

int64_t ShardSampler::size() const {
  const std::vector<int64_t> loads = deal(world_size_, taken_now()).loads;
  if (std::find(loads.begin(), loads.end(), 0) != loads.end()) {  // order()'s turns over the rest
    const int64_t n = std::accumulate(loads.begin(), loads.end(), int64_t{0});
    return options_.drop_last ? n / world_size_ : (n + world_size_ - 1) / world_size_;
  }
  return options_.drop_last ? *std::min_element(loads.begin(), loads.end()) : *std::max_element(loads.begin(), loads.end());
}

std::vector<int64_t> ShardSampler::order(int world, int rank, uint64_t round, const std::vector<uint8_t>* taken) const {
  const Deal d = deal(world, taken);
  // The samples a list of shards has left, front to back.
  const auto stream = [&](const std::vector<int64_t>& shards, auto&& visit) {
    for (const int64_t k : shards) {
      for (int64_t i = starts_[static_cast<size_t>(k)]; i < starts_[static_cast<size_t>(k) + 1]; ++i) {
        if (taken == nullptr || (*taken)[static_cast<size_t>(i)] == 0) visit(i);
      }
    }
  };
  // An epoch's rest in fewer shards than ranks: the ranks take turns over all of it, in
  // shard order, as DistributedSampler interleaves (padded or cut to equal shares).
  if (std::find(d.loads.begin(), d.loads.end(), 0) != d.loads.end()) {
    std::vector<int64_t> all;
    for (const std::vector<int64_t>& shards : d.shards) stream(shards, [&](int64_t i) { all.push_back(i); });
    const auto n = static_cast<int64_t>(all.size());
    const int64_t share = options_.drop_last ? n / world : (n + world - 1) / world;
    std::vector<int64_t> out;
    for (int64_t k = 0; k < share; ++k) out.push_back(all[static_cast<size_t>((k * world + rank) % n)]);
    return out;
  }
  const int64_t wanted = options_.drop_last ? *std::min_element(d.loads.begin(), d.loads.end())
                                            : *std::max_element(d.loads.begin(), d.loads.end());
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(wanted));
  Rng rng(mix64(mix64(mix64(options_.seed ^ 0x53484152445Full) ^ static_cast<uint64_t>(epoch())) ^
                static_cast<uint64_t>(rank)) ^
          round);
  std::vector<int64_t> buffer;
  stream(d.shards[static_cast<size_t>(rank)], [&](int64_t i) {
    if (!options_.shuffle) {
      out.push_back(i);
    } else if (static_cast<int64_t>(buffer.size()) < options_.buffer) {
      buffer.push_back(i);
    } else {
      int64_t& slot = buffer[rng.uniform_below(buffer.size())];
      out.push_back(slot);
      slot = i;
    }
  });
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
  out.resize(static_cast<size_t>(wanted));
  return out;
}

std::vector<int64_t> ShardSampler::indices() const {
  return order(world_size_, rank_, epoch() == resumed_epoch_ ? earlier_.size() : 0, taken_now());
}

// Note [An epoch of shards in several worlds]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// DistributedSampler's ranks interleave one order of the whole epoch, so what a world took is
// a prefix of it whatever the world, and a count says where the rest begins. Here each world
// deals the shards out anew, so what it took depends on its size: the first `consumed / W`
// items of each of its W ranks' orders. A resumed epoch replays its earlier worlds, oldest
// first, each dealing what the ones before it left (the k-th with its buffer's draws keyed by
// k), marks what each took, and deals the rest to this world, which reads every sample the
// earlier worlds left exactly once (padding aside) and none they took. The replay computes
// orders only, no image is read: O(samples) per earlier world.
void ShardSampler::resume_epoch(int64_t epoch, std::vector<EarlierWorld> earlier) {
  if (epoch < 0) throw InvalidArgument(fmt::format("ShardSampler::resume_epoch: expected an epoch >= 0, found {}", epoch));
  const int64_t saved = this->epoch();
  Sampler::set_epoch(epoch);
  std::vector<uint8_t> taken(static_cast<size_t>(starts_.back()), 0);
  for (size_t k = 0; k < earlier.size(); ++k) {
    const EarlierWorld& w = earlier[k];
    if (w.world_size < 1 || w.consumed < 0 || w.consumed % w.world_size != 0) {
      throw InvalidArgument(fmt::format("ShardSampler::resume_epoch: expected a world >= 1 whose ranks took equal "
                                        "shares, found {} items over {} rank(s)",
                                        w.consumed, w.world_size));
    }
    std::vector<uint8_t> after = taken;
    for (int r = 0; r < w.world_size; ++r) {
      const std::vector<int64_t> o = order(w.world_size, r, k, &taken);
      const auto share = std::min<size_t>(o.size(), static_cast<size_t>(w.consumed / w.world_size));
      for (size_t p = 0; p < share; ++p) after[static_cast<size_t>(o[p])] = 1;
    }
    taken = std::move(after);
  }
  Sampler::set_epoch(saved);
  resumed_epoch_ = epoch;
  earlier_ = std::move(earlier);
  taken_ = std::move(taken);
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
