#include "data/dataset.h"

#include <fmt/format.h>

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
  if (shape_.channels <= 0 || shape_.height <= 0 || shape_.width <= 0) {
    throw InvalidArgument(fmt::format("dataset {}: expected a positive image shape, found {}x{}x{}",
                                      name_, shape_.channels, shape_.height, shape_.width));
  }
  if (num_classes_ <= 0) {
    throw InvalidArgument(fmt::format("dataset {}: expected at least one class, found {}", name_,
                                      num_classes_));
  }
  const size_t expected_pixels = labels_.size() * static_cast<size_t>(shape_.numel());
  if (pixels_.size() != expected_pixels) {
    throw InvalidArgument(fmt::format(
        "dataset {}: expected {} pixel bytes for {} images of {}x{}x{}, found {}", name_,
        expected_pixels, labels_.size(), shape_.channels, shape_.height, shape_.width,
        pixels_.size()));
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
  return pixels_.data() + static_cast<size_t>(i) * static_cast<size_t>(shape_.numel());
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
