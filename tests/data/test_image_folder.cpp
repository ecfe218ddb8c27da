// Image folders: classes, order, pixels and channels, and every malformed folder refused.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <array>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/data_source.h"
#include "data/image_folder.h"
#include "tests/data/image_files.h"
#include "tests/data/idx_fixtures.h"
#include "tests/support/error_of.h"

using namespace mtrain;
using mtrain::testing::error_of;
using namespace mtrain::data;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

// A 2x3 gray image whose pixels are seed, seed + 1, ...
std::vector<uint8_t> gray(uint8_t seed) {
  std::vector<uint8_t> p;
  for (int i = 0; i < 6; ++i) p.push_back(static_cast<uint8_t>(seed + i));
  return p;
}

void gray_png(const fs::path& path, uint8_t seed) {
  fs::create_directories(path.parent_path());
  testing::write_png(path, 2, 3, 1, gray(seed));
}

// train/{b,a,c}, val/{a,c}: three classes sorted a, b, c.
void small_folder(const fs::path& root) {
  gray_png(root / "train/b/2.png", 20);
  gray_png(root / "train/b/1.png", 10);
  gray_png(root / "train/a/x.png", 30);
  gray_png(root / "train/c/deeper/y.png", 40);
  gray_png(root / "val/a/v.png", 50);
  gray_png(root / "val/c/w.png", 60);
}

}  // namespace

TEST_CASE("an image folder: classes sorted by name, images class by class, files sorted, pixels exact") {
  testing::ScratchDir dir;
  small_folder(dir.path());
  const DatasetSplits s = load_image_folder_splits(dir.path());
  REQUIRE(s.train.size() == 4);
  CHECK(s.train.shape() == ImageShape{1, 2, 3});
  CHECK(s.train.num_classes() == 3);
  CHECK(s.train.class_names() == std::vector<std::string>{"a", "b", "c"});
  CHECK(s.train.labels() == std::vector<int64_t>{0, 1, 1, 2});
  CHECK(std::vector<uint8_t>(s.train.image(0), s.train.image(0) + 6) == gray(30));  // a/x
  CHECK(std::vector<uint8_t>(s.train.image(1), s.train.image(1) + 6) == gray(10));  // b/1
  CHECK(std::vector<uint8_t>(s.train.image(2), s.train.image(2) + 6) == gray(20));  // b/2
  CHECK(std::vector<uint8_t>(s.train.image(3), s.train.image(3) + 6) == gray(40));  // c/deeper/y
  REQUIRE(s.test.size() == 2);
  CHECK(s.test.labels() == std::vector<int64_t>{0, 2});  // val's c is train's class 2
  CHECK(s.test.name() == "imagefolder/val");
}

TEST_CASE("colour and gray images together make 3 channels; JPEGs decode") {
  testing::ScratchDir dir;
  gray_png(dir.path() / "train/a/g.png", 100);
  const std::vector<uint8_t> rgb = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18};
  fs::create_directories(dir.path() / "train/b");
  testing::write_png(dir.path() / "train/b/c.png", 2, 3, 3, rgb);
  fs::create_directories(dir.path() / "val/b");
  testing::write_jpeg(dir.path() / "val/b/flat.jpg", 2, 3, 3, std::vector<uint8_t>(18, 200));
  const DatasetSplits s = load_image_folder_splits(dir.path());
  CHECK(s.train.shape() == ImageShape{3, 2, 3});
  // The gray image repeated in every channel; the colour one planar (CHW).
  for (int c = 0; c < 3; ++c) CHECK(s.train.image(0)[c * 6] == 100);
  CHECK(s.train.image(1)[0] == 1);
  CHECK(s.train.image(1)[1] == 4);
  CHECK(s.train.image(1)[6] == 2);
  CHECK(s.train.image(1)[12] == 3);
  for (int k = 0; k < 18; ++k) CHECK(std::abs(static_cast<int>(s.test.image(0)[k]) - 200) <= 2);
}

TEST_CASE("malformed image folders are refused, naming the file or folder") {
  testing::ScratchDir dir;
  small_folder(dir.path());
  SECTION("a file that is not an image") {
    std::ofstream(dir.path() / "train/b/notes.txt") << "hello";
    CHECK_THAT(error_of<IoError>([&] { load_image_folder_splits(dir.path()); }),
               Contains("train/b/notes.txt: expected only images (.png, .jpg, .jpeg)"));
  }
  SECTION("an image name over something else") {
    std::ofstream(dir.path() / "train/b/3.png") << "not really a png";
    CHECK_THAT(error_of<IoError>([&] { load_image_folder_splits(dir.path()); }),
               Contains("train/b/3.png: expected a PNG or a JPEG image, found 16 bytes of something else"));
  }
  SECTION("a truncated PNG") {
    const fs::path p = dir.path() / "train/b/1.png";
    fs::resize_file(p, 40);
    CHECK_THAT(error_of<IoError>([&] { load_image_folder_splits(dir.path()); }),
               Contains("train/b/1.png: not a readable PNG"));
  }
  SECTION("a class folder with no images") {
    fs::create_directories(dir.path() / "train/d");
    CHECK_THAT(error_of<IoError>([&] { load_image_folder_splits(dir.path()); }),
               Contains("train/d: class folder with no images"));
  }
  SECTION("images of another size") {
    testing::write_png(dir.path() / "train/a/z_big.png", 3, 3, 1, std::vector<uint8_t>(9, 1));
    CHECK_THAT(error_of<IoError>([&] { load_image_folder_splits(dir.path()); }),
               Contains("train/a/z_big.png: 3x3 pixels, but") && Contains("is 2x3; every image of a split must have one size (--resize HxW"));
  }
  SECTION("images of another size, resized") {
    testing::write_png(dir.path() / "train/a/z_big.png", 3, 3, 1, std::vector<uint8_t>(9, 1));
    const DatasetSplits s = load_image_folder_splits(dir.path(), {.height = 4, .width = 5});
    CHECK(s.train.shape() == ImageShape{1, 4, 5});
    CHECK(s.test.shape() == ImageShape{1, 4, 5});
    CHECK(s.train.size() == 5);
    for (int k = 0; k < 20; ++k) CHECK(s.train.image(1)[k] == 1);  // a/z_big: flat stays flat
  }
  SECTION("a validation class training never saw") {
    gray_png(dir.path() / "val/z/q.png", 1);
    CHECK_THAT(error_of<IoError>([&] { load_image_folder_splits(dir.path()); }),
               Contains("class folder 'z' is not among the training classes"));
  }
  SECTION("--skip-bad-images leaves out what does not decode and says how many") {
    std::ofstream(dir.path() / "train/b/notes.txt") << "hello";
    std::ofstream(dir.path() / "train/b/3.png") << "not really a png";
    std::ofstream(dir.path() / "val/a/broken.jpg") << "nor a jpeg";
    const DatasetSplits s = load_image_folder_splits(dir.path(), {.skip_bad_files = true});
    CHECK(s.train.size() == 4);
    CHECK(s.test.size() == 2);
    REQUIRE(s.notes.size() == 2);
    CHECK_THAT(s.notes[0], Contains("--skip-bad-images: left out 2 file(s) of train/, the first") &&
                               Contains("notes.txt: expected only images"));
    CHECK_THAT(s.notes[1], Contains("left out 1 file(s) of val/") && Contains("broken.jpg: expected a PNG or a JPEG"));
    CHECK_THAT(error_of<IoError>([&] { load_image_folder_splits(dir.path()); }), Contains("--skip-bad-images leaves such files out"));
  }
  SECTION("no val/") {
    fs::remove_all(dir.path() / "val");
    CHECK_THAT(error_of<IoError>([&] { resolve_data_dir("imagefolder", dir.path().string(), {}); }),
               Contains("expected train/ and val/ folders, each with one subfolder of images per class, missing val/"));
  }
}

TEST_CASE("resize_bilinear: PIL's triangle filter, widened when shrinking, rounded half up") {
  // Worked by hand from Pillow's Resample.c (Note [Resizing as PIL does]).
  const DecodedImage row{1, 4, 1, {0, 100, 200, 255}};
  SECTION("halving a row: each output reads three pixels, weights 3/7, 3/7, 1/7") {
    const DecodedImage half = resize_bilinear(row, 1, 2);
    CHECK(half.pixels == std::vector<uint8_t>{71, 209});  // 71.43 and 209.29
  }
  SECTION("doubling a row: the ends copy, the middles mix 3:1 and 1:3") {
    const DecodedImage wide = resize_bilinear(DecodedImage{1, 2, 1, {0, 255}}, 1, 4);
    CHECK(wide.pixels == std::vector<uint8_t>{0, 64, 191, 255});  // 63.75 rounds up
  }
  SECTION("a column resamples as the row does, channel by channel") {
    const DecodedImage column{4, 1, 3, {0, 1, 2, 100, 101, 102, 200, 201, 202, 255, 255, 255}};
    const DecodedImage half = resize_bilinear(column, 2, 1);
    CHECK(half.height == 2);
    CHECK(half.pixels[0] == 71);
    CHECK(half.pixels[3] == 209);
    CHECK(half.pixels[1] == resize_bilinear(DecodedImage{1, 4, 1, {1, 101, 201, 255}}, 1, 2).pixels[0]);
  }
  SECTION("the same size is a copy; a size below 1 is refused") {
    CHECK(resize_bilinear(row, 1, 4).pixels == row.pixels);
    CHECK_THAT(error_of<InvalidArgument>([&] { resize_bilinear(row, 0, 4); }), Contains("found 0x4"));
  }
}

// Note [RGB pixels in vector lanes]: a colour image's horizontal pass runs in vector lanes,
// a gray one's pixel by pixel. Both must give Pillow's sums, so a colour resize is three
// gray ones, for windows of every width (enlarging: 2-3 taps; shrinking up to 9x: the
// unrolled widths and the general loop), boxes with fractional ends, and sizes whose last
// row and column take the ends' special cases.
TEST_CASE("resize_bilinear of a colour image is three gray resizes, for windows of every width") {
  uint32_t state = 12345;
  const auto next = [&] { return state = state * 1664525u + 1013904223u; };
  const auto random_image = [&](int64_t h, int64_t w) {
    DecodedImage image{h, w, 3, std::vector<uint8_t>(static_cast<size_t>(h * w * 3))};
    for (uint8_t& p : image.pixels) p = static_cast<uint8_t>(next() >> 24);
    return image;
  };
  const auto channel = [](const DecodedImage& image, int64_t c) {
    DecodedImage gray{image.height, image.width, 1, std::vector<uint8_t>(static_cast<size_t>(image.height * image.width))};
    for (size_t p = 0; p < gray.pixels.size(); ++p) gray.pixels[p] = image.pixels[p * 3 + static_cast<size_t>(c)];
    return gray;
  };
  const auto check_channels = [&](const DecodedImage& colour, const std::array<DecodedImage, 3>& grays) {
    for (int64_t c = 0; c < 3; ++c) {
      REQUIRE(grays[static_cast<size_t>(c)].pixels.size() * 3 == colour.pixels.size());
      int differing = 0;
      for (size_t p = 0; p < grays[static_cast<size_t>(c)].pixels.size(); ++p) {
        differing += colour.pixels[p * 3 + static_cast<size_t>(c)] != grays[static_cast<size_t>(c)].pixels[p];
      }
      CHECK(differing == 0);
    }
  };
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{1, 1}, {3, 2}, {7, 5}, {17, 33}, {40, 9}, {64, 64}, {90, 130}};
  for (const auto& [h, w] : sizes) {
    const DecodedImage image = random_image(h, w);
    const std::array<DecodedImage, 3> planes = {channel(image, 0), channel(image, 1), channel(image, 2)};
    for (const int64_t out_w : {int64_t{1}, w / 9 + 1, w / 4 + 1, w / 3 + 1, w / 2 + 1, w - 1, w + 3, 2 * w + 1}) {
      if (out_w < 1) continue;
      const int64_t out_h = std::max<int64_t>(1, (h * out_w) / w);
      INFO(fmt::format("{}x{} to {}x{}", h, w, out_h, out_w));
      check_channels(resize_bilinear(image, out_h, out_w),
                     {resize_bilinear(planes[0], out_h, out_w), resize_bilinear(planes[1], out_h, out_w),
                      resize_bilinear(planes[2], out_h, out_w)});
      const SourceBox box{0.3 * static_cast<double>(h) / 4, 0.7, 0.6 * static_cast<double>(h),
                          static_cast<double>(w) - 0.9};
      if (box.width <= 0 || box.height <= 0) continue;
      check_channels(resize_box_bilinear(image, box, out_h, out_w),
                     {resize_box_bilinear(planes[0], box, out_h, out_w), resize_box_bilinear(planes[1], box, out_h, out_w),
                      resize_box_bilinear(planes[2], box, out_h, out_w)});
    }
  }
}

TEST_CASE("--resize and --skip-bad-images belong to image folders") {
  const DataSource cifar{"cifar10", "/nowhere", "test"};
  CHECK_THAT(error_of<InvalidArgument>([&] { load_splits(cifar, {}, {.height = 8, .width = 8}); }),
             Contains("--resize applies to --dataset imagefolder or webdataset, not to cifar10"));
  CHECK_THAT(error_of<InvalidArgument>([&] { load_splits(cifar, {}, {.skip_bad_files = true}); }),
             Contains("--skip-bad-images applies to --dataset imagefolder or webdataset, not to cifar10"));
}
