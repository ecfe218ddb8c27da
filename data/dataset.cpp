#include "data/dataset.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace mtrain::data {

Dataset::Dataset(std::string name, std::string origin, ImageShape shape, int64_t num_classes,
                 std::vector<uint8_t> pixels, std::vector<int64_t> labels)
    : name_(std::move(name)),
      origin_(std::move(origin)),
      shape_(shape),
      num_classes_(num_classes),
      pixels_(std::move(pixels)),
      labels_(std::move(labels)) {
  check_shape_and_labels();
  const size_t expected_pixels = labels_.size() * static_cast<size_t>(shape_.numel());
  if (pixels_.size() != expected_pixels) {
    throw InvalidArgument(fmt::format(
        "dataset {}: expected {} pixel bytes for {} images of {}x{}x{}, found {}", name_,
        expected_pixels, labels_.size(), shape_.channels, shape_.height, shape_.width,
        pixels_.size()));
  }
}

Dataset::Dataset(std::string name, std::string origin, ImageShape shape, int64_t num_classes,
                 std::shared_ptr<const EncodedImages> images, std::vector<int64_t> labels, ImageTransform transform)
    : name_(std::move(name)),
      origin_(std::move(origin)),
      shape_(shape),
      num_classes_(num_classes),
      labels_(std::move(labels)),
      encoded_(std::move(images)),
      transform_(transform) {
  check_shape_and_labels();
  if (encoded_ == nullptr || encoded_->size() != size()) {
    throw InvalidArgument(fmt::format("dataset {}: expected one stored image per label ({}), found {}", name_, size(),
                                      encoded_ == nullptr ? 0 : encoded_->size()));
  }
  if (transform_.height != shape_.height || transform_.width != shape_.width) {
    throw InvalidArgument(fmt::format("dataset {}: expected its transform to make {}x{} images, found {}x{} ({})",
                                      name_, shape_.height, shape_.width, transform_.height, transform_.width,
                                      transform_.describe()));
  }
}

void Dataset::check_shape_and_labels() const {
  if (shape_.channels <= 0 || shape_.height <= 0 || shape_.width <= 0) {
    throw InvalidArgument(fmt::format("dataset {}: expected a positive image shape, found {}x{}x{}",
                                      name_, shape_.channels, shape_.height, shape_.width));
  }
  if (num_classes_ <= 0) {
    throw InvalidArgument(fmt::format("dataset {}: expected at least one class, found {}", name_,
                                      num_classes_));
  }
  for (size_t i = 0; i < labels_.size(); ++i) {
    if (labels_[i] < 0 || labels_[i] >= num_classes_) {
      throw InvalidArgument(fmt::format("dataset {}: label of item {} is {}, expected [0, {}]",
                                        name_, i, labels_[i], num_classes_ - 1));
    }
  }
}

const uint8_t* Dataset::image(int64_t i) const {
  MTRAIN_CHECK(i >= 0 && i < size(), "image index {} outside dataset {} of {} items", i, name_,
               size());
  MTRAIN_CHECK(in_memory(), "dataset {} is streamed: its pixels are not in memory", name_);
  return pixels_.data() + static_cast<size_t>(i) * static_cast<size_t>(shape_.numel());
}

const std::vector<uint8_t>& Dataset::pixels() const {
  MTRAIN_CHECK(in_memory(), "dataset {} is streamed: its pixels are not in memory", name_);
  return pixels_;
}

void Dataset::read_image(int64_t i, int64_t epoch, uint8_t* out) const {
  if (in_memory()) {
    const uint8_t* from = image(i);
    std::copy(from, from + shape_.numel(), out);
    return;
  }
  const std::vector<uint8_t> bytes = encoded_->read(i);
  decode_to_chw(encoded_->where(i), bytes.data(), bytes.size(), transform_, epoch, i, shape_.channels, out);
}

int64_t Dataset::label(int64_t i) const {
  MTRAIN_CHECK(i >= 0 && i < size(), "label index {} outside dataset {} of {} items", i, name_,
               size());
  return labels_[static_cast<size_t>(i)];
}

std::string Dataset::describe() const {
  return fmt::format("{}: {} images {}x{}x{}, {} classes ({})", name_, size(), shape_.channels,
                     shape_.height, shape_.width, num_classes_, origin_);
}

void Dataset::set_class_names(std::vector<std::string> names) {
  if (static_cast<int64_t>(names.size()) != num_classes_) {
    throw InvalidArgument(fmt::format("{}: expected {} class names, found {}", name_, num_classes_, names.size()));
  }
  class_names_ = std::move(names);
}

}  // namespace mtrain::data
