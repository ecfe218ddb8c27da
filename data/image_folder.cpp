#include "data/image_folder.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cctype>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace mtrain::data {
namespace {

namespace fs = std::filesystem;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool image_extension(const fs::path& p) {
  const std::string ext = lower(p.extension().string());
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg";
}

using Item = LabelledFile;
using Skipped = std::vector<std::string>;  // why files were left out on request, in the order met

// Note [Decoding image folders]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every image is decoded once, when the set is loaded, by as many threads as there are
// cores, into the dataset's uint8 CHW bytes; an epoch then costs what an IDX or CIFAR
// epoch costs. The set must fit in memory (a 50,000-image 32x32 colour folder is 150 MB).
// Images keep their channels: a folder of grayscale images trains 1-channel models, as
// the same images in IDX files would; where any image has colour, grayscale ones are
// repeated into 3 channels (torchvision's loader converts everything to RGB). All images
// of a split must share one size, unless a resize gives them one as they are decoded.
Dataset decode_split(std::vector<Item> items, const std::string& name, const std::string& origin,
                     int64_t num_classes, const ImageFolderOptions& options, Skipped* skipped) {
  std::vector<DecodedImage> decoded(items.size());
  std::vector<std::string> failed(items.size());  // with skipping: why item i was left out
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const unsigned threads = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), 64));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (size_t i = next++; i < items.size(); i = next++) {
        try {
          decoded[i] = decode_image(items[i].path);
          if (options.resizes() && (decoded[i].height != options.height || decoded[i].width != options.width)) {
            decoded[i] = resize_bilinear(std::move(decoded[i]), options.height, options.width);
          }
        } catch (const IoError& e) {
          if (skipped != nullptr) {
            failed[i] = e.what();
            continue;
          }
          std::lock_guard<std::mutex> lock(failure_mutex);
          if (!failure) failure = std::current_exception();
          next = items.size();
        } catch (...) {
          std::lock_guard<std::mutex> lock(failure_mutex);
          if (!failure) failure = std::current_exception();
          next = items.size();
        }
      }
    });
  }
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  if (skipped != nullptr) {
    size_t kept = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!failed[i].empty()) {
        skipped->push_back(failed[i]);
        continue;
      }
      if (kept != i) {
        items[kept] = std::move(items[i]);
        decoded[kept] = std::move(decoded[i]);
      }
      ++kept;
    }
    items.resize(kept);
    decoded.resize(kept);
    if (items.empty()) throw IoError(fmt::format("{}: no image decodes", origin));
  }

  const DecodedImage& first = decoded.front();
  int64_t channels = 1;
  for (size_t i = 0; i < decoded.size(); ++i) {
    if (decoded[i].height != first.height || decoded[i].width != first.width) {
      throw IoError(fmt::format("{}: {}x{} pixels, but {} is {}x{}; every image of a split must have one size "
                                "(--resize HxW gives them one)",
                                items[i].path.string(), decoded[i].height, decoded[i].width,
                                items.front().path.string(), first.height, first.width));
    }
    channels = std::max(channels, decoded[i].channels);
  }
  const int64_t plane = first.height * first.width;
  std::vector<uint8_t> pixels(decoded.size() * static_cast<size_t>(channels * plane));
  std::vector<int64_t> labels;
  for (size_t i = 0; i < decoded.size(); ++i) {
    uint8_t* out = pixels.data() + i * static_cast<size_t>(channels * plane);
    const DecodedImage& d = decoded[i];
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t from = d.channels == 1 ? 0 : c;
      for (int64_t p = 0; p < plane; ++p) out[c * plane + p] = d.pixels[static_cast<size_t>(p * d.channels + from)];
    }
    labels.push_back(items[i].label);
  }
  return Dataset(name, origin, ImageShape{channels, first.height, first.width}, num_classes, std::move(pixels),
                 std::move(labels));
}

}  // namespace

std::vector<std::string> image_folder_classes(const fs::path& split_dir) {
  std::error_code ec;
  if (!fs::is_directory(split_dir, ec)) {
    throw IoError(fmt::format("{}: expected a folder with one subfolder of images per class, found {}",
                              split_dir.string(), fs::exists(split_dir, ec) ? "something else" : "nothing"));
  }
  std::vector<std::string> classes;
  for (const auto& entry : fs::directory_iterator(split_dir)) {
    if (entry.is_directory()) classes.push_back(entry.path().filename().string());
  }
  if (classes.empty()) {
    throw IoError(fmt::format("{}: expected one subfolder of images per class, found none", split_dir.string()));
  }
  std::sort(classes.begin(), classes.end());
  return classes;
}

std::vector<LabelledFile> image_folder_files(const fs::path& split_dir, const std::vector<std::string>& train_classes,
                                            std::vector<std::string>* skipped) {
  std::map<std::string, int64_t> index_of;
  for (size_t i = 0; i < train_classes.size(); ++i) index_of[train_classes[i]] = static_cast<int64_t>(i);
  std::vector<LabelledFile> items;
  for (const std::string& name : image_folder_classes(split_dir)) {
    const auto found = index_of.find(name);
    if (found == index_of.end()) {
      throw IoError(fmt::format("{}: class folder '{}' is not among the training classes", split_dir.string(), name));
    }
    std::vector<fs::path> files;
    for (const auto& entry : fs::recursive_directory_iterator(split_dir / name)) {
      if (!entry.is_regular_file()) continue;
      if (!image_extension(entry.path())) {
        const std::string reason = fmt::format(
            "{}: expected only images (.png, .jpg, .jpeg) in class folders, found this file", entry.path().string());
        if (skipped == nullptr) throw IoError(reason + " (--skip-bad-images leaves such files out)");
        skipped->push_back(reason);
        continue;
      }
      files.push_back(entry.path());
    }
    if (files.empty()) {
      throw IoError(fmt::format("{}: class folder with no images (.png, .jpg, .jpeg)", (split_dir / name).string()));
    }
    std::sort(files.begin(), files.end());
    for (fs::path& f : files) items.push_back({std::move(f), found->second});
  }
  return items;
}

DatasetSplits load_image_folder_splits(const fs::path& dir, const ImageFolderOptions& options) {
  const std::vector<std::string> classes = image_folder_classes(dir / kImageFolderTrain);
  const auto num_classes = static_cast<int64_t>(classes.size());
  DatasetSplits splits;
  Skipped train_skipped, val_skipped;
  Skipped* train_skip = options.skip_bad_files ? &train_skipped : nullptr;
  Skipped* val_skip = options.skip_bad_files ? &val_skipped : nullptr;
  const std::string resized =
      options.resizes() ? fmt::format(", resized to {}x{}", options.height, options.width) : std::string();
  auto train_items = image_folder_files(dir / kImageFolderTrain, classes, train_skip);
  splits.train = decode_split(std::move(train_items), "imagefolder/train",
                              fmt::format("image folder {}{}", (dir / kImageFolderTrain).string(), resized), num_classes,
                              options, train_skip);
  auto val_items = image_folder_files(dir / kImageFolderVal, classes, val_skip);
  splits.test = decode_split(std::move(val_items), "imagefolder/val",
                             fmt::format("image folder {}{}", (dir / kImageFolderVal).string(), resized), num_classes, options,
                             val_skip);
  for (const auto& [split, s] : {std::pair{"train", &train_skipped}, std::pair{"val", &val_skipped}}) {
    if (s->empty()) continue;
    splits.notes.push_back(fmt::format("--skip-bad-images: left out {} file(s) of {}/, the first {}",
                                       s->size(), split, s->front()));
  }
  if (splits.test.shape() != splits.train.shape()) {
    throw IoError(fmt::format("{}: its images are {}x{}x{}, the training images {}x{}x{}",
                              (dir / kImageFolderVal).string(), splits.test.channels(), splits.test.height(),
                              splits.test.width(), splits.train.channels(), splits.train.height(),
                              splits.train.width()));
  }
  splits.train.set_class_names(classes);
  splits.test.set_class_names(classes);
  return splits;
}

namespace {

Dataset streamed_split(const fs::path& split_dir, const std::vector<std::string>& classes, const std::string& name,
                       const ImageTransform& transform, bool skip_bad, std::vector<std::string>& notes) {
  Skipped skipped;
  std::vector<LabelledFile> files = image_folder_files(split_dir, classes, skip_bad ? &skipped : nullptr);
  if (!skipped.empty()) {
    notes.push_back(fmt::format("--skip-bad-images: left out {} file(s) of {}, the first {}", skipped.size(),
                                split_dir.string(), skipped.front()));
  }
  std::vector<fs::path> paths;
  std::vector<EncodedImages::Image> images;
  std::vector<int64_t> labels;
  for (LabelledFile& f : files) {
    images.push_back({static_cast<uint32_t>(paths.size()), 0, fs::file_size(f.path), ""});
    labels.push_back(f.label);
    paths.push_back(std::move(f.path));
  }
  if (paths.size() > UINT32_MAX) throw IoError(fmt::format("{}: more than 2^32 images", split_dir.string()));
  auto encoded = std::make_shared<const EncodedImages>(std::move(paths), std::move(images));
  return Dataset(name, fmt::format("image folder {}, read per batch", split_dir.string()),
                 ImageShape{3, transform.height, transform.width}, static_cast<int64_t>(classes.size()),
                 std::move(encoded), std::move(labels), transform);
}

}  // namespace

DatasetSplits load_image_folder_streamed(const fs::path& dir, const StreamedSplitsOptions& options) {
  const std::vector<std::string> classes = image_folder_classes(dir / kImageFolderTrain);
  DatasetSplits splits;
  splits.train = streamed_split(dir / kImageFolderTrain, classes, "imagefolder/train", options.train, options.skip_bad,
                                splits.notes);
  splits.test = streamed_split(dir / kImageFolderVal, classes, "imagefolder/val",
                               options.evaluate ? options.eval : options.train, options.skip_bad, splits.notes);
  splits.train.set_class_names(classes);
  splits.test.set_class_names(classes);
  return splits;
}

}  // namespace mtrain::data
