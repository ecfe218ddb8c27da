// Samplers decide which dataset items an epoch visits and in which order; the DataLoader cuts
// that order into batches.
//
// Contract for every Sampler: a pure function of (its configuration, the epoch; a
// GlobalBatchShardSampler's shares are configuration that set_shares changes), so indices()
// returns the same list every time for the same epoch (not concurrently with set_epoch);
// size() is its length, which need not be the dataset size (a rank-aware sampler yields only
// its shard). set_epoch(e) must be called before each epoch (DataLoader::start_epoch does it).
// Why: Note [Sampler contract] in sampler.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mtrain::data {

class Sampler {
 public:
  virtual ~Sampler() = default;

  virtual void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  // The dataset indices of the current epoch, in visiting order; each in [0, dataset size).
  virtual std::vector<int64_t> indices() const = 0;
  // indices().size(), without building the list.
  virtual int64_t size() const = 0;
  // One line for logs: "random shuffle of 6000 items (seed 0)".
  virtual std::string describe() const = 0;
  // Per-step batch sizes when the sampler decides them (GlobalBatchShardSampler): the
  // DataLoader then cuts indices() by them, summing to size(). Empty (the default): the
  // loader's batch_size decides.
  virtual std::vector<int64_t> batch_sizes() const { return {}; }

 private:
  int64_t epoch_ = 0;
};

// 0, 1, ..., n-1 every epoch (evaluation).
class SequentialSampler final : public Sampler {
 public:
  explicit SequentialSampler(int64_t dataset_size);
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return dataset_size_; }
  std::string describe() const override;

 private:
  int64_t dataset_size_;
};

// A fresh permutation of [0, n) per epoch: random_permutation(n, seed + epoch).
class RandomSampler final : public Sampler {
 public:
  RandomSampler(int64_t dataset_size, uint64_t seed);
  std::vector<int64_t> indices() const override;
  int64_t size() const override { return dataset_size_; }
  std::string describe() const override;
  uint64_t seed() const { return seed_; }

 private:
  int64_t dataset_size_;
  uint64_t seed_;
};

}  // namespace mtrain::data
