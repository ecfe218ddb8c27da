// Images kept encoded in files and read one by one when a batch needs them: the storage of a
// streamed dataset, whose files are tar shards holding many images each (data/webdataset.h)
// or image files holding one each (a streamed image folder, data/image_folder.h). Per image
// it holds where its bytes are (file, offset, size) and a name for messages, about 50
// bytes, so ImageNet's 1.28 M images cost ~64 MB of index, not their ~190 GB decoded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mtrain::data {

class EncodedImages {
 public:
  struct Image {
    uint32_t file = 0;
    uint64_t offset = 0;  // of its bytes in the file
    uint64_t size = 0;
    std::string member;   // its name inside a shard; empty for a file of its own
  };

  // `images` must be grouped by file in file order (file k's images before k + 1's);
  // InvalidArgument otherwise, or for a file number outside `files`.
  EncodedImages(std::vector<std::filesystem::path> files, std::vector<Image> images);

  int64_t size() const { return static_cast<int64_t>(images_.size()); }
  int64_t num_files() const { return static_cast<int64_t>(files_.size()); }
  const std::vector<std::filesystem::path>& files() const { return files_; }
  // Images of file k are [file_starts()[k], file_starts()[k + 1]); num_files() + 1 entries.
  const std::vector<int64_t>& file_starts() const { return starts_; }
  // Whether files hold several images (shards, read best front to back by one rank).
  bool sharded() const { return files_.size() < images_.size(); }
  const Image& image(int64_t i) const;

  // The stored bytes of image i (safe from any thread); IoError naming the file (and
  // member) when they cannot be read.
  std::vector<uint8_t> read(int64_t i) const;
  // "train-000003.tar: n01440764_10026.jpg", or the file's path, for messages.
  std::string where(int64_t i) const;

 private:
  std::vector<std::filesystem::path> files_;
  std::vector<Image> images_;
  std::vector<int64_t> starts_;
};

}  // namespace mtrain::data
