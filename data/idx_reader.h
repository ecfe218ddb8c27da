// Reader for the IDX format of MNIST and Fashion-MNIST, gzip-compressed or raw (decided by the
// first two bytes, never by the name). A file is accepted only if its payload is exactly what its
// header promises and every dimension and label is in range (Note [IDX validation] in
// idx_reader.cpp); every error is an IoError naming the file, what was expected and what was
// found. Memory grows with the bytes actually read. Free functions, no shared state.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace mtrain::data {

inline constexpr uint32_t kIdxImagesMagic = 0x00000803;
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;
inline constexpr int64_t kMaxIdxSide = 4096;          // rows and cols
inline constexpr int64_t kMaxIdxItems = 1'000'000'000;

struct IdxImages {
  int64_t count = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> pixels;  // count * rows * cols, row-major
};

IdxImages read_idx_images(const std::filesystem::path& path);
// Labels widened to int64 (the dtype of the loss); each must lie in [0, num_classes).
std::vector<int64_t> read_idx_labels(const std::filesystem::path& path, int64_t num_classes);

// One split from a pair of files; the item counts must match. `name` is the dataset's
// log name ("fashion-mnist/train").
Dataset load_idx_dataset(const std::filesystem::path& images_path,
                         const std::filesystem::path& labels_path, const std::string& name,
                         int64_t num_classes);

// The official file stems; a directory may hold each as "<stem>.gz" or as "<stem>".
inline constexpr const char* kIdxTrainImages = "train-images-idx3-ubyte";
inline constexpr const char* kIdxTrainLabels = "train-labels-idx1-ubyte";
inline constexpr const char* kIdxTestImages = "t10k-images-idx3-ubyte";
inline constexpr const char* kIdxTestLabels = "t10k-labels-idx1-ubyte";
const std::vector<std::string>& idx_file_stems();  // the four above, in that order

// "<dir>/<stem>.gz" if it exists, else "<dir>/<stem>" if it exists, else nullopt.
std::optional<std::filesystem::path> find_idx_file(const std::filesystem::path& dir,
                                                   const std::string& stem);

// Train and test splits of a directory holding the four official files. `dataset` names
// the splits ("<dataset>/train", "<dataset>/test"). 10 classes.
DatasetSplits load_idx_splits(const std::filesystem::path& dir, const std::string& dataset);

}  // namespace mtrain::data
