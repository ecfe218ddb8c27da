// Reader for the IDX format of MNIST and Fashion-MNIST, gzip-compressed or raw.
//
// Note [IDX validation]
// ~~~~~~~~~~~~~~~~~~~~~
// IDX is a big-endian header followed by raw bytes: images are magic 0x00000803
// (uint8, 3 dims), item count, rows, cols; labels are magic 0x00000801 (uint8, 1 dim),
// item count. Whether a file is gzip is decided by its first two bytes (1f 8b), never
// by its name, because people gunzip files and keep the name or the other way round.
// A file is accepted only if the payload is exactly what the header promises: fewer
// bytes is "truncated", more is "trailing bytes", so a half-downloaded or concatenated
// file fails loudly instead of training on garbage. (Bytes after a complete gzip
// stream that are not another gzip member are skipped by zlib's gzread, as gunzip
// warns about and skips them; the payload they follow is whole.) A gzip stream must
// also reach its 8-byte trailer, whose CRC is the only check that the data arrived
// intact: one that stops after the payload is "truncated" too. Dimensions are read from the
// header (28x28 for these datasets) but must be in [1, kMaxIdxSide]; labels must be
// in [0, num_classes). Memory grows with the bytes actually read, so a header that
// lies about its count cannot make the reader allocate gigabytes. Every error is an
// IoError naming the file, what was expected and what was found.
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
