// The `synthetic` dataset: Fashion-MNIST-shaped (1x28x28, 10 classes) images generated
// from a seed, for runs and tests that need no files.
//
// Note [Synthetic data]
// ~~~~~~~~~~~~~~~~~~~~~
// Each class has a fixed prototype: stripes at a class-specific angle and frequency
// under a Gaussian spot at a class-specific place. The prototypes do not depend on the
// seed (train and test must share classes); the seed drives the labels, a shift of up
// to +-2 pixels, a contrast factor and Gaussian pixel noise. So the data is learnable
// (a nearest-class-mean classifier on raw pixels is far above chance) without being
// trivial, identical for equal seeds on every machine (data/random.h), and the train
// and test splits are different draws (streams 2*seed and 2*seed+1).
#pragma once

#include <cstdint>
#include <string>

#include "data/dataset.h"

namespace mtrain::data {

struct SyntheticOptions {
  int64_t train_size = 6000;
  int64_t test_size = 1000;
  uint64_t seed = 0;
};

inline constexpr int64_t kSyntheticClasses = 10;
inline constexpr int64_t kSyntheticSide = 28;

// `size` images drawn from stream `stream` (see the Note); `name` is the log name.
Dataset make_synthetic_dataset(int64_t size, uint64_t stream, const std::string& name);

// "synthetic/train" (stream 2*seed) and "synthetic/test" (stream 2*seed+1).
DatasetSplits make_synthetic_splits(const SyntheticOptions& options);

}  // namespace mtrain::data
