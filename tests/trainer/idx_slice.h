// A small slice of the shipped Fashion-MNIST subset written as raw IDX files, for runs
// that must be short whatever the model (resnet18 on 16 images).
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "data/idx_reader.h"

namespace mtrain::testing {

// One raw IDX file: the magic, the dimensions, then `bytes` bytes of data.
inline void write_idx_file(const std::string& path, uint32_t magic, std::vector<uint32_t> dims, const uint8_t* data,
                           size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  dims.insert(dims.begin(), magic);
  for (uint32_t v : dims) {
    const char be[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                        static_cast<char>(v)};
    out.write(be, 4);
  }
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

// Writes the first `count` training and test images of the IDX set in `source_dir` as
// raw IDX files (the reader takes gzip or raw) into `dir`.
inline void write_idx_slice(const std::string& source_dir, const std::string& dir, int64_t count) {
  const auto write = [&](const std::string& name, uint32_t magic, std::vector<uint32_t> dims, const uint8_t* data,
                         size_t bytes) { write_idx_file(dir + "/" + name, magic, std::move(dims), data, bytes); };
  for (const std::string split : {"train", "t10k"}) {
    const auto images = data::read_idx_images(source_dir + "/" + split + "-images-idx3-ubyte.gz");
    const auto labels = data::read_idx_labels(source_dir + "/" + split + "-labels-idx1-ubyte.gz", 10);
    REQUIRE(images.count >= count);
    std::vector<uint8_t> label_bytes(labels.begin(), labels.begin() + count);
    write(split + "-images-idx3-ubyte", data::kIdxImagesMagic,
          {static_cast<uint32_t>(count), static_cast<uint32_t>(images.rows), static_cast<uint32_t>(images.cols)},
          images.pixels.data(), static_cast<size_t>(count * images.rows * images.cols));
    write(split + "-labels-idx1-ubyte", data::kIdxLabelsMagic, {static_cast<uint32_t>(count)},
          label_bytes.data(), label_bytes.size());
  }
}

}  // namespace mtrain::testing
