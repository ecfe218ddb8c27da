#include "data/sampler.h"

#include <fmt/format.h>

#include "core/error.h"
#include "data/random.h"

// Note [Sampler contract]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A sampler is a pure function of (its configuration, the epoch): indices() returns the same list
// every time it is called for the same epoch, so the DataLoader may call it once per epoch from the
// consumer thread and hand slices to worker threads. size() is the length of that list, which need
// not be the dataset size: a rank-aware sampler (DistributedSampler) yields only its shard, padded
// or trimmed so that every rank gets the same count. set_epoch(e) must be called before each epoch
// (the DataLoader's start_epoch does it); without it a shuffling sampler would repeat one order
// forever. Shuffles use random_permutation(n, seed + epoch) (data/random.h), like PyTorch's seed +
// epoch convention, so all ranks agree on the global order without talking.

namespace mtrain::data {
namespace {

void check_dataset_size(int64_t n, const char* sampler) {
  if (n < 0) {
    throw InvalidArgument(fmt::format("{}: expected a dataset size >= 0, found {}", sampler, n));
  }
}

}  // namespace

SequentialSampler::SequentialSampler(int64_t dataset_size) : dataset_size_(dataset_size) {
  check_dataset_size(dataset_size, "SequentialSampler");
}

std::vector<int64_t> SequentialSampler::indices() const {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  for (int64_t i = 0; i < dataset_size_; ++i) order[static_cast<size_t>(i)] = i;
  return order;
}

std::string SequentialSampler::describe() const {
  return fmt::format("sequential order of {} items", dataset_size_);
}

RandomSampler::RandomSampler(int64_t dataset_size, uint64_t seed)
    : dataset_size_(dataset_size), seed_(seed) {
  check_dataset_size(dataset_size, "RandomSampler");
}

std::vector<int64_t> RandomSampler::indices() const {
  return random_permutation(dataset_size_, seed_ + static_cast<uint64_t>(epoch()));
}

std::string RandomSampler::describe() const {
  return fmt::format("random shuffle of {} items (seed {} + epoch)", dataset_size_, seed_);
}

}  // namespace mtrain::data
