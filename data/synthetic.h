// The `synthetic` dataset: Fashion-MNIST-shaped (1x28x28, 10 classes) images generated from a
// seed, for runs and tests that need no files, or images of another shape (3x224x224 for
// benchmarks without data: --synthetic-shape). Learnable but not trivial, identical for
// equal seeds on every machine, with train and test as different draws (Note [Synthetic
// data] in synthetic.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "data/dataset.h"

namespace mtrain::data {

inline constexpr int64_t kSyntheticClasses = 10;
inline constexpr int64_t kSyntheticSide = 28;

struct SyntheticOptions {
  int64_t train_size = 6000;
  int64_t test_size = 1000;
  uint64_t seed = 0;
  ImageShape shape{1, kSyntheticSide, kSyntheticSide};
};

// `size` images of `shape` (1 or 3 channels, sides >= 8) drawn from stream `stream`; `name`
// is the log name. InvalidArgument for another shape.
Dataset make_synthetic_dataset(int64_t size, uint64_t stream, const std::string& name,
                               ImageShape shape = {1, kSyntheticSide, kSyntheticSide});

// "synthetic/train" (stream 2*seed) and "synthetic/test" (stream 2*seed+1).
DatasetSplits make_synthetic_splits(const SyntheticOptions& options);

}  // namespace mtrain::data
