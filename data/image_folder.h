// A folder of images per class, as torchvision's ImageFolder reads it: DIR/train/<class>/...
// and DIR/val/<class>/... (PNG and JPEG, data/image_decode.h; files in subfolders of a
// class count too). Classes are the train folder's subfolders sorted by
// name (byte order, as Python's sorted), numbered from 0; images are taken class by class,
// each class's files sorted by path. Every image is decoded once, at load, on all cores,
// into the same uint8 CHW form as the IDX and CIFAR sets (Note [Decoding image folders]),
// as torchvision's loader sees it: PIL's Image.open(f).convert("RGB") where any image has
// colour, and with a resize, .resize((width, height), Image.BILINEAR) (Note [Resizing as
// PIL does] in image_decode.cpp).
// Every error is an IoError naming the file or folder, what was expected and what was found.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_decode.h"

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

struct LabelledFile {
  std::filesystem::path path;
  int64_t label = 0;
};
// The image files (.png, .jpg, .jpeg) of a split folder, class by class, each class's sorted
// by path, labelled by their class's place in `train_classes`. IoError for a class folder not
// among them, one without images, or another file; with `skipped`, such a file is left out
// and why is appended there instead.
std::vector<LabelledFile> image_folder_files(const std::filesystem::path& split_dir,
                                            const std::vector<std::string>& train_classes,
                                            std::vector<std::string>* skipped = nullptr);

// Train and val splits of DIR kept encoded in their files and decoded per batch through
// `options`' transforms (a streamed set, as WebDataset shards are): for folders larger than
// memory and random crops drawn per epoch. The images come in 3 channels (RGB), as
// torchvision's loader gives them; files that are not images are left out under skip_bad.
DatasetSplits load_image_folder_streamed(const std::filesystem::path& dir, const StreamedSplitsOptions& options);

// Train and val splits of DIR; val's classes must be among train's.
DatasetSplits load_image_folder_splits(const std::filesystem::path& dir, const ImageFolderOptions& options = {});

}  // namespace mtrain::data
