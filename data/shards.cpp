#include "data/shards.h"

#include <fmt/format.h>

#include "core/error.h"
#include "data/tar.h"

namespace mtrain::data {

ShardedImages::ShardedImages(std::vector<std::filesystem::path> shards, std::vector<Image> images)
    : shards_(std::move(shards)), images_(std::move(images)), starts_(shards_.size() + 1, 0) {
  uint32_t last = 0;
  for (const Image& image : images_) {
    if (image.shard >= shards_.size() || image.shard < last) {
      throw InvalidArgument(fmt::format("ShardedImages: expected images grouped by shard, in order, among {} shards; "
                                        "found shard {} after shard {}",
                                        shards_.size(), image.shard, last));
    }
    last = image.shard;
    ++starts_[image.shard + 1];
  }
  for (size_t k = 1; k < starts_.size(); ++k) starts_[k] += starts_[k - 1];
}

const ShardedImages::Image& ShardedImages::image(int64_t i) const {
  MTRAIN_CHECK(i >= 0 && i < size(), "image {} outside {} sharded images", i, size());
  return images_[static_cast<size_t>(i)];
}

// One open per image: a reader holds no descriptors between batches, however many shards
// there are (the open costs microseconds next to a JPEG's milliseconds of decoding).
std::vector<uint8_t> ShardedImages::read(int64_t i) const {
  const Image& m = image(i);
  const ReadOnlyFile file(shards_[m.shard]);
  return file.read(m.offset, m.size, fmt::format("member {}", m.member));
}

std::string ShardedImages::where(int64_t i) const {
  const Image& m = image(i);
  return fmt::format("{}: {}", shards_[m.shard].string(), m.member);
}

}  // namespace mtrain::data
