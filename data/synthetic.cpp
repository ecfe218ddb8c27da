#include "data/synthetic.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "data/random.h"

// Note [Synthetic data]
// ~~~~~~~~~~~~~~~~~~~~~
// Each class has a fixed prototype: stripes at a class-specific angle and frequency under a
// Gaussian spot at a class-specific place. The prototypes do not depend on the seed (train and
// test must share classes); the seed drives the labels, a shift of up to +-2 pixels, a contrast
// factor and Gaussian pixel noise. So the data is learnable (a nearest-class-mean classifier on
// raw pixels is far above chance) without being trivial, identical for equal seeds on every
// machine (data/random.h), and the train and test splits are different draws (streams 2*seed and
// 2*seed+1).

namespace mtrain::data {
namespace {

constexpr int kSide = static_cast<int>(kSyntheticSide);
constexpr int kMaxShift = 2;
constexpr double kNoiseStddev = 0.15;
constexpr double kPi = 3.141592653589793;

using Prototype = std::array<float, kSide * kSide>;

// Values in [0, 1]; see Note [Synthetic data].
Prototype make_prototype(int cls) {
  const double angle = kPi * cls / kSyntheticClasses;
  const double frequency = 2.0 * kPi * (2 + cls % 3) / kSide;
  const double spot_y = 14.0 + 6.0 * std::sin(2.0 * kPi * cls / kSyntheticClasses);
  const double spot_x = 14.0 + 6.0 * std::cos(2.0 * kPi * cls / kSyntheticClasses);
  Prototype p{};
  for (int y = 0; y < kSide; ++y) {
    for (int x = 0; x < kSide; ++x) {
      const double along = x * std::cos(angle) + y * std::sin(angle);
      const double stripes = 0.5 + 0.5 * std::cos(frequency * along);
      const double d2 = (y - spot_y) * (y - spot_y) + (x - spot_x) * (x - spot_x);
      const double spot = std::exp(-d2 / (2.0 * 5.0 * 5.0));
      p[static_cast<size_t>(y * kSide + x)] = static_cast<float>(0.35 * stripes + 0.65 * spot);
    }
  }
  return p;
}

const std::array<Prototype, kSyntheticClasses>& prototypes() {
  static const std::array<Prototype, kSyntheticClasses> all = [] {
    std::array<Prototype, kSyntheticClasses> made{};
    for (int c = 0; c < kSyntheticClasses; ++c) made[static_cast<size_t>(c)] = make_prototype(c);
    return made;
  }();
  return all;
}

}  // namespace

Dataset make_synthetic_dataset(int64_t size, uint64_t stream, const std::string& name) {
  if (size < 1) {
    throw InvalidArgument(
        fmt::format("synthetic dataset {}: expected at least 1 image, found {}", name, size));
  }
  const auto& protos = prototypes();
  const size_t image_bytes = static_cast<size_t>(kSide) * kSide;
  std::vector<uint8_t> pixels(static_cast<size_t>(size) * image_bytes);
  std::vector<int64_t> labels(static_cast<size_t>(size));
  Rng rng(stream);
  for (int64_t i = 0; i < size; ++i) {
    const auto label = static_cast<int64_t>(rng.uniform_below(kSyntheticClasses));
    const int dy = static_cast<int>(rng.uniform_below(2 * kMaxShift + 1)) - kMaxShift;
    const int dx = static_cast<int>(rng.uniform_below(2 * kMaxShift + 1)) - kMaxShift;
    const double contrast = 0.7 + 0.3 * rng.uniform01();
    const Prototype& proto = protos[static_cast<size_t>(label)];
    uint8_t* out = pixels.data() + static_cast<size_t>(i) * image_bytes;
    for (int y = 0; y < kSide; ++y) {
      for (int x = 0; x < kSide; ++x) {
        // Shifted-in borders are black, like a digit moved inside its frame.
        const int sy = y - dy;
        const int sx = x - dx;
        const bool inside = sy >= 0 && sy < kSide && sx >= 0 && sx < kSide;
        const double base = inside ? proto[static_cast<size_t>(sy * kSide + sx)] : 0.0;
        const double value = std::clamp(contrast * base + kNoiseStddev * rng.normal(), 0.0, 1.0);
        out[static_cast<size_t>(y * kSide + x)] = static_cast<uint8_t>(std::lround(value * 255.0));
      }
    }
    labels[static_cast<size_t>(i)] = label;
  }
  return Dataset(name, fmt::format("synthetic, stream {}", stream),
                 ImageShape{1, kSyntheticSide, kSyntheticSide}, kSyntheticClasses,
                 std::move(pixels), std::move(labels));
}

DatasetSplits make_synthetic_splits(const SyntheticOptions& options) {
  DatasetSplits splits;
  splits.train = make_synthetic_dataset(options.train_size, 2 * options.seed, "synthetic/train");
  splits.test = make_synthetic_dataset(options.test_size, 2 * options.seed + 1, "synthetic/test");
  return splits;
}

}  // namespace mtrain::data
