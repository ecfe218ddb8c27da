// Reader for the binary versions of CIFAR-10 and CIFAR-100 (the "-binary" archives from
// the CIFAR page). Each file is a run of fixed-size records: the label byte(s), then the
// 32x32 image as 1,024 red, 1,024 green and 1,024 blue bytes (already CHW). A file is
// accepted only if it holds a whole, non-zero number of records and every label is in
// range; every error is an IoError naming the file, what was expected and what was found.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace mtrain::data {

// What distinguishes the two formats.
struct CifarFormat {
  std::string dataset;                    // "cifar10" or "cifar100"
  std::vector<std::string> train_files;   // in reading order
  std::vector<std::string> test_files;
  int64_t label_bytes;                    // 1 (CIFAR-10) or 2 (CIFAR-100: coarse, fine)
  int64_t num_classes;                    // 10, or CIFAR-100's 100 fine labels
};

inline constexpr int64_t kCifarSide = 32;
inline constexpr int64_t kCifarImageBytes = 3 * kCifarSide * kCifarSide;

bool is_cifar(const std::string& dataset);
// The format of "cifar10" or "cifar100"; InvalidArgument for any other name.
const CifarFormat& cifar_format(const std::string& dataset);

// The files of `format` that `dir` lacks; empty when it is complete.
std::vector<std::string> missing_cifar_files(const std::filesystem::path& dir, const CifarFormat& format);

// One split from the files named, read in order and concatenated. `name` is the log name.
Dataset load_cifar_dataset(const std::vector<std::filesystem::path>& files, const CifarFormat& format,
                           const std::string& name);

// Train and test splits of a directory holding every file of the format.
DatasetSplits load_cifar_splits(const std::filesystem::path& dir, const std::string& dataset);

}  // namespace mtrain::data
