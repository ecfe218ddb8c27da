// Images kept encoded in tar shards, read one by one when a batch needs them: the storage
// of a streamed dataset (data/webdataset.h builds it). Per image it holds where its bytes
// are (shard, offset, size) and its member's name for messages, about 50 bytes, so
// ImageNet's 1.28 M images cost ~64 MB of index, not their ~190 GB decoded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mtrain::data {

class ShardedImages {
 public:
  struct Image {
    uint32_t shard = 0;
    uint64_t offset = 0;  // of the member's data in the shard
    uint64_t size = 0;
    std::string member;
  };

  // `images` must be grouped by shard in shard order (shard k's images before k + 1's);
  // InvalidArgument otherwise, or for a shard number outside `shards`.
  ShardedImages(std::vector<std::filesystem::path> shards, std::vector<Image> images);

  int64_t size() const { return static_cast<int64_t>(images_.size()); }
  int64_t num_shards() const { return static_cast<int64_t>(shards_.size()); }
  const std::vector<std::filesystem::path>& shards() const { return shards_; }
  // Images of shard k are [shard_starts()[k], shard_starts()[k + 1]); num_shards() + 1 entries.
  const std::vector<int64_t>& shard_starts() const { return starts_; }
  const Image& image(int64_t i) const;

  // The stored bytes of image i, read from its shard (safe from any thread); IoError
  // naming the shard and member when they cannot be read.
  std::vector<uint8_t> read(int64_t i) const;
  // "train-000003.tar: n01440764_10026.jpg", for messages.
  std::string where(int64_t i) const;

 private:
  std::vector<std::filesystem::path> shards_;
  std::vector<Image> images_;
  std::vector<int64_t> starts_;
};

}  // namespace mtrain::data
