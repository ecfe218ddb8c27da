#include "data/encoded_images.h"

#include <fmt/format.h>

#include "core/error.h"
#include "data/tar.h"

namespace mtrain::data {

EncodedImages::EncodedImages(std::vector<std::filesystem::path> files, std::vector<Image> images)
    : files_(std::move(files)), images_(std::move(images)), starts_(files_.size() + 1, 0) {
  uint32_t last = 0;
  for (const Image& image : images_) {
    if (image.file >= files_.size() || image.file < last) {
      throw InvalidArgument(fmt::format("EncodedImages: expected images grouped by file, in order, among {} files; "
                                        "found file {} after file {}",
                                        files_.size(), image.file, last));
    }
    last = image.file;
    ++starts_[image.file + 1];
  }
  for (size_t k = 1; k < starts_.size(); ++k) starts_[k] += starts_[k - 1];
}

const EncodedImages::Image& EncodedImages::image(int64_t i) const {
  MTRAIN_CHECK(i >= 0 && i < size(), "image {} outside {} encoded images", i, size());
  return images_[static_cast<size_t>(i)];
}

// One open per image: a reader holds no descriptors between batches, however many files
// there are (the open costs microseconds next to a JPEG's milliseconds of decoding).
std::vector<uint8_t> EncodedImages::read(int64_t i) const {
  const Image& m = image(i);
  const ReadOnlyFile file(files_[m.file]);
  return file.read(m.offset, m.size, m.member.empty() ? "the image" : fmt::format("member {}", m.member));
}

std::string EncodedImages::where(int64_t i) const {
  const Image& m = image(i);
  return m.member.empty() ? files_[m.file].string() : fmt::format("{}: {}", files_[m.file].string(), m.member);
}

}  // namespace mtrain::data
