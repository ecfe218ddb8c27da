#include "data/pack/pack.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>

#include "core/error.h"
#include "core/files.h"
#include "data/image_decode.h"
#include "data/image_folder.h"
#include "data/random.h"
#include "data/shard_index.h"
#include "data/tar.h"

namespace mtrain::data {
namespace {

namespace fs = std::filesystem;

PackedSplit pack_split(const fs::path& split_dir, const std::vector<std::string>& classes, const fs::path& out_dir,
                       const std::string& split, const PackOptions& options) {
  std::vector<LabelledFile> files = image_folder_files(split_dir, classes);
  const std::vector<int64_t> order = random_permutation(static_cast<int64_t>(files.size()), options.seed);
  fs::create_directories(out_dir);
  PackedSplit packed{split, static_cast<int64_t>(files.size()), {}};
  const std::string stem = split.empty() ? "shard" : split;
  for (int64_t first = 0; first < static_cast<int64_t>(files.size()); first += options.shard_size) {
    const fs::path shard = out_dir / fmt::format("{}-{:06}.tar", stem, packed.shards.size());
    TarWriter tar(shard);
    const int64_t last = std::min<int64_t>(first + options.shard_size, static_cast<int64_t>(files.size()));
    for (int64_t k = first; k < last; ++k) {
      const LabelledFile& file = files[static_cast<size_t>(order[static_cast<size_t>(k)])];
      const std::vector<uint8_t> bytes = read_file_bytes(file.path);
      if (!is_png_or_jpeg(bytes.data(), bytes.size())) {
        throw IoError(fmt::format("{}: expected a PNG or a JPEG image, found {} bytes of something else",
                                  file.path.string(), bytes.size()));
      }
      std::string ext = file.path.extension().string();
      std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      const std::string key = fmt::format("{:09}", k);
      tar.add(key + ext, bytes);
      const std::string label = std::to_string(file.label);
      tar.add(key + ".cls", std::vector<uint8_t>(label.begin(), label.end()));
    }
    tar.finish();
    write_shard_index(shard);  // Note [Shard index files]
    packed.shards.push_back(shard);
  }
  return packed;
}

}  // namespace

// Note [Packing shards]
// ~~~~~~~~~~~~~~~~~~~~~
// A rank reads its shards front to back through a shuffle buffer (Note [Shards per rank] in
// shard_sampler.cpp), which mixes only the samples of a few shards at a time. Written class by
// class, as an image folder lists them, a shard would hold one or two classes and a batch
// would see few classes at once; so the samples are written in a random order (seeded), and
// every shard is a sample of the whole set. Keys are the samples' numbers in that order
// (nine digits, no '.', which would end the key), so no file name is too long for ustar, and
// the image keeps its own bytes and extension (nothing is decoded or re-encoded).
std::vector<PackedSplit> pack_image_folder(const fs::path& from, const fs::path& to, const PackOptions& options) {
  if (options.shard_size < 1) {
    throw InvalidArgument(fmt::format("--shard-size: expected at least 1 sample a shard, found {}", options.shard_size));
  }
  std::error_code ec;
  const bool splits = fs::is_directory(from / kImageFolderTrain, ec);
  const std::vector<std::string> classes = image_folder_classes(splits ? from / kImageFolderTrain : from);
  std::vector<PackedSplit> packed;
  if (splits) {
    packed.push_back(pack_split(from / kImageFolderTrain, classes, to / kImageFolderTrain, kImageFolderTrain, options));
    if (fs::is_directory(from / kImageFolderVal, ec)) {
      packed.push_back(pack_split(from / kImageFolderVal, classes, to / kImageFolderVal, kImageFolderVal, options));
    }
  } else {
    packed.push_back(pack_split(from, classes, to, "", options));
  }
  std::string names;
  for (const std::string& c : classes) names += c + "\n";
  replace_file((to / "classes.txt").string(), names);
  return packed;
}

int64_t write_shard_indexes(const std::vector<fs::path>& shards) {
  std::atomic<int64_t> samples{0};
  for_each_shard(shards.size(), [&](size_t k) {
    samples += static_cast<int64_t>(write_shard_index(shards[k]).samples.size());
  });
  return samples;
}

}  // namespace mtrain::data
