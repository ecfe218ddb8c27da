#include "data/synthetic.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>
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
// 2*seed+1). Another shape scales the prototypes (the stripes, the spot and the shift grow with
// the side), and in colour each class tints the three channels its own way; 1x28x28 is drawn
// exactly as before it could be changed.

namespace mtrain::data {
namespace {

constexpr int kMaxShift = 2;
constexpr double kNoiseStddev = 0.15;
constexpr double kPi = 3.141592653589793;

// One class's prototype at height x width, values in [0, 1]; see Note [Synthetic data]. At
// 28x28 the scale is 1 and the arithmetic is the original's.
std::vector<float> make_prototype(int cls, int64_t height, int64_t width) {
  const double sy = static_cast<double>(height) / kSyntheticSide, sx = static_cast<double>(width) / kSyntheticSide;
  const double angle = kPi * cls / kSyntheticClasses;
  const double frequency = 2.0 * kPi * (2 + cls % 3) / kSyntheticSide;
  const double spot_y = 14.0 + 6.0 * std::sin(2.0 * kPi * cls / kSyntheticClasses);
  const double spot_x = 14.0 + 6.0 * std::cos(2.0 * kPi * cls / kSyntheticClasses);
  std::vector<float> p(static_cast<size_t>(height * width));
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      const double u = static_cast<double>(x) / sx, v = static_cast<double>(y) / sy;  // in 28x28 units
      const double along = u * std::cos(angle) + v * std::sin(angle);
      const double stripes = 0.5 + 0.5 * std::cos(frequency * along);
      const double d2 = (v - spot_y) * (v - spot_y) + (u - spot_x) * (u - spot_x);
      const double spot = std::exp(-d2 / (2.0 * 5.0 * 5.0));
      p[static_cast<size_t>(y * width + x)] = static_cast<float>(0.35 * stripes + 0.65 * spot);
    }
  }
  return p;
}

const std::vector<std::vector<float>>& prototypes(int64_t height, int64_t width) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, std::vector<std::vector<float>>> made;
  std::lock_guard lock(mutex);
  auto& all = made[{height, width}];
  if (all.empty()) {
    for (int c = 0; c < kSyntheticClasses; ++c) all.push_back(make_prototype(c, height, width));
  }
  return all;
}

// A colour class's weight of channel c: 1 in gray.
double tint(int64_t cls, int64_t c, int64_t channels) {
  if (channels == 1) return 1.0;
  return 0.6 + 0.4 * std::cos(2.0 * kPi * (static_cast<double>(cls) / kSyntheticClasses + static_cast<double>(c) / 3.0));
}

}  // namespace

Dataset make_synthetic_dataset(int64_t size, uint64_t stream, const std::string& name, ImageShape shape) {
  if (size < 1) {
    throw InvalidArgument(
        fmt::format("synthetic dataset {}: expected at least 1 image, found {}", name, size));
  }
  if ((shape.channels != 1 && shape.channels != 3) || shape.height < 8 || shape.width < 8 || shape.height > 4096 ||
      shape.width > 4096) {
    throw InvalidArgument(fmt::format("synthetic dataset {}: expected 1 or 3 channels and sides of 8 to 4096, found "
                                      "{}x{}x{}",
                                      name, shape.channels, shape.height, shape.width));
  }
  const int64_t h = shape.height, w = shape.width, channels = shape.channels;
  const auto& protos = prototypes(h, w);
  const double scale = static_cast<double>(std::min(h, w)) / kSyntheticSide;
  const int max_shift = static_cast<int>(std::lround(kMaxShift * scale));
  const size_t image_bytes = static_cast<size_t>(shape.numel());
  std::vector<uint8_t> pixels(static_cast<size_t>(size) * image_bytes);
  std::vector<int64_t> labels(static_cast<size_t>(size));
  Rng rng(stream);
  for (int64_t i = 0; i < size; ++i) {
    const auto label = static_cast<int64_t>(rng.uniform_below(kSyntheticClasses));
    const int dy = static_cast<int>(rng.uniform_below(static_cast<uint64_t>(2 * max_shift + 1))) - max_shift;
    const int dx = static_cast<int>(rng.uniform_below(static_cast<uint64_t>(2 * max_shift + 1))) - max_shift;
    const double contrast = 0.7 + 0.3 * rng.uniform01();
    const std::vector<float>& proto = protos[static_cast<size_t>(label)];
    uint8_t* image = pixels.data() + static_cast<size_t>(i) * image_bytes;
    for (int64_t c = 0; c < channels; ++c) {
      const double weight = contrast * tint(label, c, channels);
      uint8_t* out = image + c * h * w;
      for (int64_t y = 0; y < h; ++y) {
        for (int64_t x = 0; x < w; ++x) {
          // Shifted-in borders are black, like a digit moved inside its frame.
          const int64_t sy = y - dy;
          const int64_t sx = x - dx;
          const bool inside = sy >= 0 && sy < h && sx >= 0 && sx < w;
          const double base = inside ? proto[static_cast<size_t>(sy * w + sx)] : 0.0;
          const double value = std::clamp(weight * base + kNoiseStddev * rng.normal(), 0.0, 1.0);
          out[static_cast<size_t>(y * w + x)] = static_cast<uint8_t>(std::lround(value * 255.0));
        }
      }
    }
    labels[static_cast<size_t>(i)] = label;
  }
  return Dataset(name, fmt::format("synthetic, stream {}", stream), shape, kSyntheticClasses, std::move(pixels),
                 std::move(labels));
}

DatasetSplits make_synthetic_splits(const SyntheticOptions& options) {
  DatasetSplits splits;
  splits.train = make_synthetic_dataset(options.train_size, 2 * options.seed, "synthetic/train", options.shape);
  splits.test = make_synthetic_dataset(options.test_size, 2 * options.seed + 1, "synthetic/test", options.shape);
  return splits;
}

}  // namespace mtrain::data
