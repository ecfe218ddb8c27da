#include "data/image_folder.h"

#include <fmt/format.h>
#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <atomic>
#include <cctype>
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

std::vector<uint8_t> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("{}: cannot open it for reading", path.string()));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return bytes;
}

DecodedImage decode_png(const fs::path& path, const std::vector<uint8_t>& bytes) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (png_image_begin_read_from_memory(&image, bytes.data(), bytes.size()) == 0) {
    throw IoError(fmt::format("{}: not a readable PNG: {}", path.string(), image.message));
  }
  const bool colour = (image.format & PNG_FORMAT_FLAG_COLOR) != 0;
  image.format = colour ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;  // alpha composited onto black
  DecodedImage out{image.height, image.width, colour ? 3 : 1, std::vector<uint8_t>(PNG_IMAGE_SIZE(image))};
  if (png_image_finish_read(&image, nullptr, out.pixels.data(), 0, nullptr) == 0) {
    const std::string message = image.message;
    png_image_free(&image);
    throw IoError(fmt::format("{}: not a readable PNG: {}", path.string(), message));
  }
  return out;
}

DecodedImage decode_jpeg(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::unique_ptr<void, int (*)(tjhandle)> handle(tjInitDecompress(), tjDestroy);
  if (!handle) throw IoError(fmt::format("{}: libjpeg-turbo could not start a decoder", path.string()));
  int width = 0, height = 0, subsampling = 0, colourspace = 0;
  auto* data = const_cast<unsigned char*>(bytes.data());
  const auto size = static_cast<unsigned long>(bytes.size());
  if (tjDecompressHeader3(handle.get(), data, size, &width, &height, &subsampling, &colourspace) != 0) {
    throw IoError(fmt::format("{}: not a readable JPEG: {}", path.string(), tjGetErrorStr2(handle.get())));
  }
  const bool gray = colourspace == TJCS_GRAY;
  DecodedImage out{height, width, gray ? 1 : 3,
                   std::vector<uint8_t>(static_cast<size_t>(width) * static_cast<size_t>(height) * (gray ? 1 : 3))};
  if (tjDecompress2(handle.get(), data, size, out.pixels.data(), width, 0, height, gray ? TJPF_GRAY : TJPF_RGB, 0) != 0 &&
      tjGetErrorCode(handle.get()) == TJERR_FATAL) {
    throw IoError(fmt::format("{}: not a readable JPEG: {}", path.string(), tjGetErrorStr2(handle.get())));
  }
  return out;
}

struct Item {
  fs::path path;
  int64_t label;
};

// Files left out on request, in the order met.
struct Skipped {
  std::vector<std::string> reasons;
};

std::vector<Item> list_items(const fs::path& split_dir, const std::vector<std::string>& classes,
                             const std::map<std::string, int64_t>& index_of, Skipped* skipped) {
  std::vector<Item> items;
  for (const std::string& name : classes) {
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
        skipped->reasons.push_back(reason);
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

// Note [Decoding image folders]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every image is decoded once, when the set is loaded, by as many threads as there are
// cores, into the dataset's uint8 CHW bytes; an epoch then costs what an IDX or CIFAR
// epoch costs. The set must fit in memory (a 50,000-image 32x32 colour folder is 150 MB).
// Images keep their channels: a folder of grayscale images trains 1-channel models, as
// the same images in IDX files would; where any image has colour, grayscale ones are
// repeated into 3 channels (torchvision's loader converts everything to RGB). All images
// of a split must share one size (no resizing yet).
Dataset decode_split(std::vector<Item> items, const std::string& name, const std::string& origin,
                     int64_t num_classes, Skipped* skipped) {
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
        skipped->reasons.push_back(failed[i]);
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
      throw IoError(fmt::format("{}: {}x{} pixels, but {} is {}x{}; every image of a split must have one size",
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

DecodedImage decode_image(const fs::path& path) {
  const std::vector<uint8_t> bytes = read_file(path);
  static const uint8_t kPng[] = {0x89, 'P', 'N', 'G'};
  if (bytes.size() >= 4 && std::equal(kPng, kPng + 4, bytes.begin())) return decode_png(path, bytes);
  if (bytes.size() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF) return decode_jpeg(path, bytes);
  throw IoError(fmt::format("{}: expected a PNG or a JPEG image, found {} bytes of something else", path.string(),
                            bytes.size()));
}

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

DatasetSplits load_image_folder_splits(const fs::path& dir, bool skip_bad_files) {
  const std::vector<std::string> classes = image_folder_classes(dir / kImageFolderTrain);
  std::map<std::string, int64_t> index_of;
  for (size_t i = 0; i < classes.size(); ++i) index_of[classes[i]] = static_cast<int64_t>(i);
  const auto num_classes = static_cast<int64_t>(classes.size());
  DatasetSplits splits;
  Skipped train_skipped, val_skipped;
  Skipped* train_skip = skip_bad_files ? &train_skipped : nullptr;
  Skipped* val_skip = skip_bad_files ? &val_skipped : nullptr;
  auto train_items = list_items(dir / kImageFolderTrain, classes, index_of, train_skip);
  splits.train = decode_split(std::move(train_items), "imagefolder/train",
                              fmt::format("image folder {}", (dir / kImageFolderTrain).string()), num_classes,
                              train_skip);
  auto val_items = list_items(dir / kImageFolderVal, image_folder_classes(dir / kImageFolderVal), index_of, val_skip);
  splits.test = decode_split(std::move(val_items), "imagefolder/val",
                             fmt::format("image folder {}", (dir / kImageFolderVal).string()), num_classes, val_skip);
  for (const auto& [split, s] : {std::pair{"train", &train_skipped}, std::pair{"val", &val_skipped}}) {
    if (s->reasons.empty()) continue;
    splits.notes.push_back(fmt::format("--skip-bad-images: left out {} file(s) of {}/, the first {}",
                                       s->reasons.size(), split, s->reasons.front()));
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

}  // namespace mtrain::data
