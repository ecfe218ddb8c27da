// The shipped Fashion-MNIST subset as an image folder and as IDX files holding the same
// images in the same order, so that training on either must give the same weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fmt/format.h>
#include <numeric>
#include <string>
#include <vector>

#include "data/idx_reader.h"
#include "tests/data/image_files.h"
#include "tests/trainer/idx_slice.h"

namespace mtrain::testing {

// The first `count` training and test images of `source_dir`, ordered as an image folder
// orders them (by class, then by index), written as raw IDX files into idx_dir and as
// PNGs into folder_dir/train/<label>/<index>.png and folder_dir/val/<label>/<index>.png.
inline void export_as_image_folder(const std::string& source_dir, int64_t count, const std::filesystem::path& idx_dir,
                                   const std::filesystem::path& folder_dir) {
  namespace fs = std::filesystem;
  fs::create_directories(idx_dir);
  for (const std::string split : {"train", "t10k"}) {
    const auto images = data::read_idx_images(source_dir + "/" + split + "-images-idx3-ubyte.gz");
    const auto labels = data::read_idx_labels(source_dir + "/" + split + "-labels-idx1-ubyte.gz", 10);
    std::vector<int64_t> order(static_cast<size_t>(count));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return labels[a] < labels[b]; });
    const int64_t plane = images.rows * images.cols;
    std::vector<uint8_t> pixels, label_bytes;
    const fs::path split_dir = folder_dir / (split == "train" ? "train" : "val");
    for (int64_t i : order) {
      const auto* p = images.pixels.data() + i * plane;
      pixels.insert(pixels.end(), p, p + plane);
      label_bytes.push_back(static_cast<uint8_t>(labels[static_cast<size_t>(i)]));
      const fs::path dir = split_dir / std::to_string(labels[static_cast<size_t>(i)]);
      fs::create_directories(dir);
      write_png(dir / fmt::format("{:05}.png", i), images.rows, images.cols, 1, std::vector<uint8_t>(p, p + plane));
    }
    write_idx_file((idx_dir / (split + "-images-idx3-ubyte")).string(), data::kIdxImagesMagic,
                   {static_cast<uint32_t>(count), static_cast<uint32_t>(images.rows), static_cast<uint32_t>(images.cols)},
                   pixels.data(), pixels.size());
    write_idx_file((idx_dir / (split + "-labels-idx1-ubyte")).string(), data::kIdxLabelsMagic,
                   {static_cast<uint32_t>(count)}, label_bytes.data(), label_bytes.size());
  }
}

}  // namespace mtrain::testing
