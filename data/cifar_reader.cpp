#include "data/cifar_reader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>

#include "core/error.h"

namespace mtrain::data {
namespace {

namespace fs = std::filesystem;

const std::vector<CifarFormat>& formats() {
  static const std::vector<CifarFormat> all = {
      {"cifar10",
       {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin"},
       {"test_batch.bin"},
       1,
       10},
      {"cifar100", {"train.bin"}, {"test.bin"}, 2, 100},
  };
  return all;
}

std::vector<uint8_t> read_whole(const fs::path& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) throw IoError(fmt::format("{}: cannot read its size: {}", path.string(), ec.message()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("{}: cannot open it for reading", path.string()));
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
  if (in.gcount() != static_cast<std::streamsize>(size)) {
    throw IoError(fmt::format("{}: expected {} bytes, read {}", path.string(), size, in.gcount()));
  }
  return bytes;
}

}  // namespace

bool is_cifar(const std::string& dataset) {
  for (const CifarFormat& f : formats()) {
    if (f.dataset == dataset) return true;
  }
  return false;
}

const CifarFormat& cifar_format(const std::string& dataset) {
  for (const CifarFormat& f : formats()) {
    if (f.dataset == dataset) return f;
  }
  throw InvalidArgument(fmt::format("expected cifar10 or cifar100, found '{}'", dataset));
}

std::vector<std::string> missing_cifar_files(const fs::path& dir, const CifarFormat& format) {
  std::vector<std::string> missing;
  std::error_code ec;
  for (const auto* list : {&format.train_files, &format.test_files}) {
    for (const std::string& file : *list) {
      if (!fs::is_regular_file(dir / file, ec)) missing.push_back(file);
    }
  }
  return missing;
}

Dataset load_cifar_dataset(const std::vector<fs::path>& files, const CifarFormat& format,
                           const std::string& name) {
  const int64_t record = format.label_bytes + kCifarImageBytes;
  std::vector<uint8_t> pixels;
  std::vector<int64_t> labels;
  std::vector<std::string> origins;
  for (const fs::path& path : files) {
    const std::vector<uint8_t> bytes = read_whole(path);
    const auto size = static_cast<int64_t>(bytes.size());
    if (size == 0 || size % record != 0) {
      throw IoError(fmt::format(
          "{}: expected a whole number of {}-byte records ({} label byte{} and a 3x32x32 image), "
          "found {} bytes{}; is it {}'s binary version, complete?",
          path.string(), record, format.label_bytes, format.label_bytes == 1 ? "" : "s", size,
          size == 0 ? "" : fmt::format(" ({} records and {} bytes over)", size / record, size % record),
          format.dataset));
    }
    const int64_t count = size / record;
    pixels.reserve(pixels.size() + static_cast<size_t>(count * kCifarImageBytes));
    for (int64_t r = 0; r < count; ++r) {
      const uint8_t* p = bytes.data() + r * record;
      // CIFAR-100 stores the coarse label first, then the fine one, which is the class.
      const int64_t label = p[format.label_bytes - 1];
      if (label >= format.num_classes) {
        throw IoError(fmt::format("{}: record {} has label {}, expected 0 to {} ({} classes)", path.string(), r,
                                  label, format.num_classes - 1, format.dataset));
      }
      labels.push_back(label);
      pixels.insert(pixels.end(), p + format.label_bytes, p + record);
    }
    origins.push_back(path.filename().string());
  }
  const std::string origin =
      fmt::format("{} binary {}", format.dataset,
                  files.empty() ? std::string() : fmt::format("{}/{{{}}}", files.front().parent_path().string(),
                                                               fmt::join(origins, ",")));
  return Dataset(name, origin, ImageShape{3, kCifarSide, kCifarSide}, format.num_classes, std::move(pixels),
                 std::move(labels));
}

DatasetSplits load_cifar_splits(const fs::path& dir, const std::string& dataset) {
  const CifarFormat& format = cifar_format(dataset);
  const std::vector<std::string> missing = missing_cifar_files(dir, format);
  if (!missing.empty()) {
    throw IoError(fmt::format("dataset directory {}: expected {}'s binary files, missing {}", dir.string(), dataset,
                              fmt::join(missing, ", ")));
  }
  const auto paths = [&](const std::vector<std::string>& names) {
    std::vector<fs::path> out;
    for (const std::string& n : names) out.push_back(dir / n);
    return out;
  };
  DatasetSplits splits;
  splits.train = load_cifar_dataset(paths(format.train_files), format, dataset + "/train");
  splits.test = load_cifar_dataset(paths(format.test_files), format, dataset + "/test");
  return splits;
}

}  // namespace mtrain::data
