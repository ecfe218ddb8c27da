#include "data/sampler.h"

#include <fmt/format.h>

#include "core/error.h"
#include "data/random.h"

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
