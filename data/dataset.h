// Dataset: labelled images, as uint8 pixels (NCHW) held in memory, or encoded in shards and
// decoded when a batch needs them (a streamed set: data/webdataset.h), and int64 labels.
// Fashion-MNIST, MNIST, CIFAR, image folders and the synthetic set are held in memory;
// conversion to float happens per batch in the DataLoader, so a 60,000-image set costs
// 47 MB, not 188 MB.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/image_decode.h"
#include "data/encoded_images.h"

namespace mtrain::data {

struct ImageShape {
  int64_t channels = 1;
  int64_t height = 28;
  int64_t width = 28;

  int64_t numel() const { return channels * height * width; }
  bool operator==(const ImageShape&) const = default;
};

class Dataset {
 public:
  Dataset() = default;
  // Throws InvalidArgument unless pixels.size() == labels.size() * shape.numel(), the
  // shape is positive and every label lies in [0, num_classes).
  Dataset(std::string name, std::string origin, ImageShape shape, int64_t num_classes,
          std::vector<uint8_t> pixels, std::vector<int64_t> labels);
  // A streamed set: image i is `images`' image i decoded through `transform`, which makes it
  // shape's height x width. Throws InvalidArgument unless there is one label per image,
  // the transform's size is the shape's, and the labels lie in [0, num_classes).
  Dataset(std::string name, std::string origin, ImageShape shape, int64_t num_classes,
          std::shared_ptr<const EncodedImages> images, std::vector<int64_t> labels, ImageTransform transform);

  int64_t size() const { return static_cast<int64_t>(labels_.size()); }
  const ImageShape& shape() const { return shape_; }
  int64_t channels() const { return shape_.channels; }
  int64_t height() const { return shape_.height; }
  int64_t width() const { return shape_.width; }
  int64_t num_classes() const { return num_classes_; }
  const std::string& name() const { return name_; }      // "fashion-mnist/train"
  const std::string& origin() const { return origin_; }  // where the data came from

  // Whether the pixels are in memory (image(), pixels()); else they are encoded().
  bool in_memory() const { return encoded_ == nullptr; }
  // Pixels of item i (shape().numel() bytes, CHW). i must be in [0, size()); in memory only.
  const uint8_t* image(int64_t i) const;
  // Item i's pixels as an epoch sees them: in memory, a copy of image(i); streamed, read,
  // decoded and transformed (its random draws are the epoch's). Writes shape().numel() bytes
  // to `out`; IoError naming the shard and member when the image does not decode.
  void read_image(int64_t i, int64_t epoch, uint8_t* out) const;
  // A streamed set's storage and transform (null and unused for one in memory).
  const EncodedImages* encoded() const { return encoded_.get(); }
  const std::shared_ptr<const EncodedImages>& shared_encoded() const { return encoded_; }
  const ImageTransform& transform() const { return transform_; }
  int64_t label(int64_t i) const;
  const std::vector<int64_t>& labels() const { return labels_; }
  const std::vector<uint8_t>& pixels() const;  // in memory only

  // Names of the classes by label, where the data has them (an image folder's); else empty.
  const std::vector<std::string>& class_names() const { return class_names_; }
  // InvalidArgument unless there is one name per class.
  void set_class_names(std::vector<std::string> names);

  // One line for logs: "fashion-mnist/train: 6000 images 1x28x28, 10 classes (<origin>)".
  std::string describe() const;

 private:
  void check_shape_and_labels() const;

  std::string name_;
  std::string origin_;
  ImageShape shape_;
  int64_t num_classes_ = 0;
  std::vector<uint8_t> pixels_;
  std::vector<int64_t> labels_;
  std::vector<std::string> class_names_;
  std::shared_ptr<const EncodedImages> encoded_;
  ImageTransform transform_;
};

// What a run asks of a streamed set's splits (--dataset webdataset, or an image folder given
// a crop; trainer/options.cpp decides it from the flags).
struct StreamedSplitsOptions {
  ImageTransform train;   // the training images' transform; height 0: not streamed
  ImageTransform eval;    // the evaluation images'
  // webdataset: the evaluation shards (a folder or a pattern); empty: DATA_DIR/val when the
  // data dir is a folder holding train/ and val/.
  std::string val_data;
  bool evaluate = true;   // false: no evaluation images are needed or read
  // Leave out (and count) samples and files that are not images or do not decode.
  bool skip_bad = false;

  bool streamed() const { return train.height > 0; }
};

struct DatasetSplits {
  Dataset train;
  Dataset test;
  std::vector<std::string> notes;  // lines for the log (files skipped on request)
};

}  // namespace mtrain::data
