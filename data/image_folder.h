// A folder of images per class, as torchvision's ImageFolder reads it: DIR/train/<class>/...
// and DIR/val/<class>/... (PNG through libpng, JPEG through libjpeg-turbo; files in
// subfolders of a class count too). Classes are the train folder's subfolders sorted by
// name (byte order, as Python's sorted), numbered from 0; images are taken class by class,
// each class's files sorted by path. Every image is decoded once, at load, on all cores,
// into the same uint8 CHW form as the IDX and CIFAR sets (Note [Decoding image folders]),
// as torchvision's loader sees it: PIL's Image.open(f).convert("RGB") where any image has
// colour, and with a resize, .resize((width, height), Image.BILINEAR) (Note [Resizing as
// PIL does]).
// Every error is an IoError naming the file or folder, what was expected and what was found.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace mtrain::data {

inline constexpr const char* kImageFolderTrain = "train";
inline constexpr const char* kImageFolderVal = "val";

// The class names of a split folder (its subfolders, sorted); IoError when it has none.
std::vector<std::string> image_folder_classes(const std::filesystem::path& split_dir);

struct ImageFolderOptions {
  // A file that is not an image or does not decode is left out instead of stopping the
  // load; the splits' notes then count them and name the first (--skip-bad-images).
  bool skip_bad_files = false;
  // Every image resampled to height x width (--resize); 0 x 0 keeps each image's own
  // size, and then all the images of a split must share one.
  int64_t height = 0;
  int64_t width = 0;
  bool resizes() const { return height > 0; }
};

// Train and val splits of DIR; val's classes must be among train's.
DatasetSplits load_image_folder_splits(const std::filesystem::path& dir, const ImageFolderOptions& options = {});

// One decoded image: height x width x channels (1 or 3) bytes, row-major, interleaved.
struct DecodedImage {
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
  std::vector<uint8_t> pixels;
};
// Decodes a PNG or a JPEG (by content, not by name); IoError naming `path` otherwise.
// An alpha channel is dropped, as PIL's convert("RGB") and convert("L") drop it.
DecodedImage decode_image(const std::filesystem::path& path);

// PIL's Image.resize((width, height), Image.BILINEAR) of an 8-bit image, to the byte:
// a triangle filter widened by the scale when shrinking (so every source pixel counts),
// fixed-point weights, the width first, then the height. Both sizes >= 1.
DecodedImage resize_bilinear(DecodedImage image, int64_t height, int64_t width);

}  // namespace mtrain::data
