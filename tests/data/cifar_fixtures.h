// Writes CIFAR-10/100-format binary files for tests: records of label byte(s) and a
// 3x32x32 image whose pixels are a function of (file, record, byte), so a test can say
// which bytes each image must hold.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/cifar_reader.h"

namespace mtrain::testing {

inline uint8_t cifar_pixel(int64_t file, int64_t record, int64_t byte) {
  return static_cast<uint8_t>((file * 131 + record * 17 + byte * 7) % 251);
}

// `count` records, labels (record + file) % classes (CIFAR-100: coarse label 99 - fine).
inline void write_cifar_file(const std::filesystem::path& path, const data::CifarFormat& format, int64_t file,
                             int64_t count) {
  std::ofstream out(path, std::ios::binary);
  for (int64_t r = 0; r < count; ++r) {
    const auto fine = static_cast<uint8_t>((r + file) % format.num_classes);
    if (format.label_bytes == 2) out.put(static_cast<char>(99 - fine));
    out.put(static_cast<char>(fine));
    for (int64_t b = 0; b < data::kCifarImageBytes; ++b) out.put(static_cast<char>(cifar_pixel(file, r, b)));
  }
}

// Every file of the format in `dir`: `per_file` records each, files numbered in order
// (train files first, then test files).
inline void write_cifar_dir(const std::filesystem::path& dir, const std::string& dataset, int64_t per_file) {
  const data::CifarFormat& format = data::cifar_format(dataset);
  std::filesystem::create_directories(dir);
  int64_t file = 0;
  for (const auto* list : {&format.train_files, &format.test_files}) {
    for (const std::string& name : *list) write_cifar_file(dir / name, format, file++, per_file);
  }
}

}  // namespace mtrain::testing
