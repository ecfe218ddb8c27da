#include "data/image_folder.h"

#include <fmt/format.h>
#include <png.h>
#include <turbojpeg.h>

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

std::vector<uint8_t> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("{}: cannot open it for reading", path.string()));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return bytes;
}

// Note [PNGs through libpng's full API]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// libpng's simplified API would be shorter, but it corrects a file's gAMA chunk towards
// sRGB and composites alpha onto a background; PIL does neither (convert("RGB") drops
// alpha, gamma is ignored), and torchvision trains on PIL's bytes. So the full API, with
// only the transforms that give PIL's bytes: palette and low bit depths expanded,
// transparency and alpha dropped, 16 bits cut to their high byte. libpng reports errors
// by longjmp; the two functions that call into it hold only trivially destructible
// locals, and everything else is allocated outside them.
struct PngDecoder {
  png_structp png = nullptr;
  png_infop info = nullptr;
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t at = 0;
  char message[256] = "";
  PngDecoder(const uint8_t* bytes, size_t n) : data(bytes), size(n) {}
  PngDecoder(const PngDecoder&) = delete;
  PngDecoder& operator=(const PngDecoder&) = delete;
  ~PngDecoder() {
    if (png != nullptr) png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr);
  }
};

void png_fail(png_structp png, png_const_charp message) {
  auto* d = static_cast<PngDecoder*>(png_get_error_ptr(png));
  std::snprintf(d->message, sizeof d->message, "%s", message);
  png_longjmp(png, 1);
}

void png_ignore_warning(png_structp, png_const_charp) {}

void png_read_memory(png_structp png, png_bytep out, size_t n) {
  auto* d = static_cast<PngDecoder*>(png_get_io_ptr(png));
  if (n > d->size - d->at) png_error(png, "the file ends early");
  std::memcpy(out, d->data + d->at, n);
  d->at += n;
}

// The header, and the transforms to PIL's bytes; false with d->message on an error.
bool png_read_header(PngDecoder* d, png_uint_32* width, png_uint_32* height, int* channels) {
  if (setjmp(png_jmpbuf(d->png))) return false;
  png_set_read_fn(d->png, d, png_read_memory);
  png_read_info(d->png, d->info);
  png_set_expand(d->png);
  png_set_strip_16(d->png);
  png_set_strip_alpha(d->png);
  png_set_interlace_handling(d->png);
  png_read_update_info(d->png, d->info);
  *width = png_get_image_width(d->png, d->info);
  *height = png_get_image_height(d->png, d->info);
  *channels = png_get_channels(d->png, d->info);
  return true;
}

bool png_read_rows(PngDecoder* d, png_bytepp rows) {
  if (setjmp(png_jmpbuf(d->png))) return false;
  png_read_image(d->png, rows);
  return true;
}

DecodedImage decode_png(const fs::path& path, const std::vector<uint8_t>& bytes) {
  PngDecoder d(bytes.data(), bytes.size());
  const auto fail = [&] { return IoError(fmt::format("{}: not a readable PNG: {}", path.string(), d.message)); };
  d.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &d, png_fail, png_ignore_warning);
  if (d.png != nullptr) d.info = png_create_info_struct(d.png);
  if (d.info == nullptr) throw IoError(fmt::format("{}: libpng could not start a decoder", path.string()));
  png_uint_32 width = 0, height = 0;
  int channels = 0;
  if (!png_read_header(&d, &width, &height, &channels)) throw fail();
  if (channels != 1 && channels != 3) {
    throw IoError(fmt::format("{}: expected gray or RGB after dropping alpha, found {} channels", path.string(), channels));
  }
  constexpr uint64_t kMaxBytes = uint64_t{1} << 30;
  if (uint64_t{width} * height * static_cast<uint64_t>(channels) > kMaxBytes) {
    throw IoError(fmt::format("{}: {}x{} pixels, more than 1 GiB decoded", path.string(), height, width));
  }
  DecodedImage out{height, width, channels,
                   std::vector<uint8_t>(static_cast<size_t>(width) * height * static_cast<size_t>(channels))};
  std::vector<png_bytep> rows(height);
  for (png_uint_32 y = 0; y < height; ++y) rows[y] = out.pixels.data() + static_cast<size_t>(y) * width * channels;
  if (!png_read_rows(&d, rows.data())) throw fail();
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

// Note [Resizing as PIL does]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchvision's ImageFolder hands Resize a PIL image, so the bytes a PyTorch user trains
// on are PIL's resample (Pillow's Resample.c): for each output pixel, a triangle filter
// centred at (x + 0.5) * scale, its support widened to `scale` when shrinking, weights
// normalised to sum 1 and then rounded to 22-bit fixed point; the sum rounds half up and
// clamps to 0..255. The width is resampled first, the rows rounded to bytes, then the
// height; a side that keeps its size is not resampled. Doing the same arithmetic gives
// PIL's bytes exactly (tests/data/test_image_folder_pil.cpp checks it against Pillow).
constexpr int kResampleBits = 22;

struct ResampleTaps {
  int64_t size = 0;               // taps per output pixel (the widest window)
  std::vector<int64_t> first;     // per output pixel: its first input pixel
  std::vector<int64_t> count;     // per output pixel: how many input pixels it reads
  std::vector<int32_t> weights;   // per output pixel: `size` fixed-point weights
};

ResampleTaps bilinear_taps(int64_t in_size, int64_t out_size) {
  const double scale = static_cast<double>(in_size) / static_cast<double>(out_size);
  const double filter_scale = std::max(scale, 1.0);
  const double support = filter_scale;  // the triangle's support is 1
  ResampleTaps taps;
  taps.size = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  taps.first.resize(static_cast<size_t>(out_size));
  taps.count.resize(static_cast<size_t>(out_size));
  taps.weights.assign(static_cast<size_t>(out_size * taps.size), 0);
  std::vector<double> w(static_cast<size_t>(taps.size));
  for (int64_t o = 0; o < out_size; ++o) {
    const double centre = (static_cast<double>(o) + 0.5) * scale;
    const auto lo = std::max<int64_t>(static_cast<int64_t>(centre - support + 0.5), 0);
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(centre + support + 0.5), in_size) - lo;
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double x = std::abs((static_cast<double>(i + lo) - centre + 0.5) / filter_scale);
      w[static_cast<size_t>(i)] = x < 1.0 ? 1.0 - x : 0.0;
      total += w[static_cast<size_t>(i)];
    }
    taps.first[static_cast<size_t>(o)] = lo;
    taps.count[static_cast<size_t>(o)] = n;
    for (int64_t i = 0; i < n; ++i) {
      const double normalised = total != 0.0 ? w[static_cast<size_t>(i)] / total : w[static_cast<size_t>(i)];
      taps.weights[static_cast<size_t>(o * taps.size + i)] =
          static_cast<int32_t>(normalised * (1 << kResampleBits) + 0.5);  // weights are >= 0
    }
  }
  return taps;
}

uint8_t resampled_byte(int32_t sum) {
  if (sum <= 0) return 0;
  if (sum >= (255 << kResampleBits)) return 255;
  return static_cast<uint8_t>(sum >> kResampleBits);
}

// One pass along the pixels `step` apart (step = channels: along a row; row length x
// channels: down a column); `lines` lines of `in_size` pixels, `line_step` apart.
void resample(const uint8_t* in, uint8_t* out, const ResampleTaps& taps, int64_t lines, int64_t in_line_step,
              int64_t out_line_step, int64_t in_step, int64_t out_step, int64_t channels, int64_t out_size) {
  for (int64_t line = 0; line < lines; ++line) {
    const uint8_t* src = in + line * in_line_step;
    uint8_t* dst = out + line * out_line_step;
    for (int64_t o = 0; o < out_size; ++o) {
      const int32_t* k = taps.weights.data() + o * taps.size;
      const int64_t lo = taps.first[static_cast<size_t>(o)];
      const int64_t n = taps.count[static_cast<size_t>(o)];
      for (int64_t c = 0; c < channels; ++c) {
        int32_t sum = 1 << (kResampleBits - 1);
        for (int64_t i = 0; i < n; ++i) sum += src[(lo + i) * in_step + c] * k[i];
        dst[o * out_step + c] = resampled_byte(sum);
      }
    }
  }
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

DecodedImage resize_bilinear(DecodedImage image, int64_t height, int64_t width) {
  if (height < 1 || width < 1) {
    throw InvalidArgument(fmt::format("resize_bilinear: expected a size of at least 1x1, found {}x{}", height, width));
  }
  DecodedImage current = std::move(image);
  const int64_t c = current.channels;
  if (width != current.width) {
    DecodedImage wide{current.height, width, c, std::vector<uint8_t>(static_cast<size_t>(current.height * width * c))};
    resample(current.pixels.data(), wide.pixels.data(), bilinear_taps(current.width, width), current.height,
             current.width * c, width * c, c, c, c, width);
    current = std::move(wide);
  }
  if (height != current.height) {
    DecodedImage tall{height, width, c, std::vector<uint8_t>(static_cast<size_t>(height * width * c))};
    // Down the columns: a "line" is one column of one channel-interleaved pixel.
    resample(current.pixels.data(), tall.pixels.data(), bilinear_taps(current.height, height), width, c, c,
             width * c, width * c, c, height);
    current = std::move(tall);
  }
  return current;
}

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

DatasetSplits load_image_folder_splits(const fs::path& dir, const ImageFolderOptions& options) {
  const std::vector<std::string> classes = image_folder_classes(dir / kImageFolderTrain);
  std::map<std::string, int64_t> index_of;
  for (size_t i = 0; i < classes.size(); ++i) index_of[classes[i]] = static_cast<int64_t>(i);
  const auto num_classes = static_cast<int64_t>(classes.size());
  DatasetSplits splits;
  Skipped train_skipped, val_skipped;
  Skipped* train_skip = options.skip_bad_files ? &train_skipped : nullptr;
  Skipped* val_skip = options.skip_bad_files ? &val_skipped : nullptr;
  const std::string resized =
      options.resizes() ? fmt::format(", resized to {}x{}", options.height, options.width) : std::string();
  auto train_items = list_items(dir / kImageFolderTrain, classes, index_of, train_skip);
  splits.train = decode_split(std::move(train_items), "imagefolder/train",
                              fmt::format("image folder {}{}", (dir / kImageFolderTrain).string(), resized), num_classes,
                              options, train_skip);
  auto val_items = list_items(dir / kImageFolderVal, image_folder_classes(dir / kImageFolderVal), index_of, val_skip);
  splits.test = decode_split(std::move(val_items), "imagefolder/val",
                             fmt::format("image folder {}{}", (dir / kImageFolderVal).string(), resized), num_classes, options,
                             val_skip);
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
