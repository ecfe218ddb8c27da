// A tiny dataset whose images name their own index, for the data-loading tests.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "data/dataset.h"

namespace mtrain::testing {

// n items of 2x3x4 whose first two pixels spell the index (i % 256, i / 256), so every
// image is distinct and traceable; label i % 10.
inline std::shared_ptr<const data::Dataset> traceable_dataset(int64_t n) {
  const data::ImageShape shape{2, 3, 4};
  std::vector<uint8_t> pixels(static_cast<size_t>(n * shape.numel()));
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* img = pixels.data() + i * shape.numel();
    for (int64_t k = 0; k < shape.numel(); ++k) img[k] = static_cast<uint8_t>((i * 31 + k * 17) % 256);
    img[0] = static_cast<uint8_t>(i % 256);
    img[1] = static_cast<uint8_t>(i / 256);
    labels[static_cast<size_t>(i)] = i % 10;
  }
  return std::make_shared<const data::Dataset>("traceable", "test fixture", shape, 10,
                                               std::move(pixels), std::move(labels));
}

}  // namespace mtrain::testing
