// Streamed images' transforms against torchvision's on the same files (Debian's
// python3-torchvision, at /usr/bin/python3): RandomResizedCrop's crop and resize once its
// box is drawn (the draw is mtrain's own: Note [Random resized crops]; a JPEG's box decoded
// alone, JPEGs subsampled 4:4:4 and 4:2:0), and the evaluation
// transform Resize(S) then CenterCrop(C), to the byte. Skips without torchvision.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "data/image_decode.h"
#include "tests/data/image_files.h"
#include "tests/support/skip.h"
#include "tests/support/test_paths.h"
#include "tests/trainer/temp_dir.h"

using namespace mtrain::data;
namespace fs = std::filesystem;

TEST_CASE("RandomResizedCrop's resize of its box and Resize + CenterCrop give torchvision's bytes") {
  if (std::system("/usr/bin/python3 -c 'import torchvision' 2>/dev/null") != 0) {
    mtrain::testing::skip_test_binary("/usr/bin/python3 has no torchvision (Debian's python3-torchvision)");
  }
  mtrain::testing::TempDir dir;
  struct Case {
    fs::path path;
    DecodedImage image;
    CropBox box;
    int64_t size, shorter;
  };
  std::vector<Case> cases;
  // Sizes around ImageNet's (landscape, portrait), small ones that are enlarged, odd sides.
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{375, 500}, {500, 333}, {64, 48}, {17, 23}, {224, 224}, {9, 40}};
  for (size_t k = 0; k < sizes.size(); ++k) {
    const auto [h, w] = sizes[k];
    std::vector<uint8_t> pixels;
    for (int64_t y = 0; y < h; ++y) {
      for (int64_t x = 0; x < w; ++x) {
        for (int c = 0; c < 3; ++c) pixels.push_back(static_cast<uint8_t>((x * 7 + y * 3 + c * 50 + (x * y) % 13) % 256));
      }
    }
    const fs::path path = dir.path() / fmt::format("{}.{}", k, k % 2 == 0 ? "jpg" : "png");
    if (k % 2 == 0) {
      mtrain::testing::write_jpeg(path, h, w, 3, pixels, 90, k % 4 == 0 ? TJSAMP_420 : TJSAMP_444);
    } else {
      mtrain::testing::write_png(path, h, w, 3, pixels);
    }
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      const int64_t size = k % 3 == 0 ? 224 : 32;
      Case c{path, decode_image(path), {}, size, size * 8 / 7};
      c.box = random_resized_crop_box(11, epoch, static_cast<int64_t>(k), c.image.height, c.image.width);
      cases.push_back(std::move(c));
    }
  }
  {
    std::ofstream list(dir.file("cases.txt"));
    for (const Case& c : cases) {
      list << fmt::format("{} {} {} {} {} {} {}\n", c.path.string(), c.box.top, c.box.left, c.box.height, c.box.width,
                          c.size, c.shorter);
    }
  }
  const std::string command = fmt::format("/usr/bin/python3 {}/tests/data/torchvision_transforms.py '{}' '{}'",
                                          mtrain::testing::source_dir(), dir.file("cases.txt"), dir.file("out.bin"));
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream in(dir.file("out.bin"), std::ios::binary);
  const std::vector<uint8_t> expected{std::istreambuf_iterator<char>(in), {}};
  size_t at = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const int64_t bytes = 3 * c.size * c.size;
    REQUIRE(at + 2 * static_cast<size_t>(bytes) <= expected.size());
    std::vector<uint8_t> ours(static_cast<size_t>(bytes));
    // The same draw as the box above: epoch i % 3, index = the image's number; a JPEG's box
    // decoded alone (Note [Decoding a crop's region]).
    std::ifstream file(c.path, std::ios::binary);
    const std::vector<uint8_t> encoded{std::istreambuf_iterator<char>(file), {}};
    decode_to_chw(c.path.string(), encoded.data(), encoded.size(),
                  {ImageTransform::Kind::kRandomResizedCrop, c.size, c.size, 0, 11}, static_cast<int64_t>(i % 3),
                  static_cast<int64_t>(i / 3), 3, ours.data());
    std::vector<uint8_t> full(ours.size());
    transform_to_chw(c.image, {ImageTransform::Kind::kRandomResizedCrop, c.size, c.size, 0, 11},
                     static_cast<int64_t>(i % 3), static_cast<int64_t>(i / 3), 3, full.data());
    CHECK(full == ours);
    INFO(fmt::format("{} ({}x{}), box {}x{} at ({}, {}) to {}", c.path.filename().string(), c.image.height,
                     c.image.width, c.box.height, c.box.width, c.box.top, c.box.left, c.size));
    CHECK(std::equal(ours.begin(), ours.end(), expected.begin() + static_cast<std::ptrdiff_t>(at)));
    at += static_cast<size_t>(bytes);
    transform_to_chw(c.image, {ImageTransform::Kind::kCenterCrop, c.size, c.size, c.shorter, 0}, 0, 0, 3, ours.data());
    INFO("Resize(" << c.shorter << "), CenterCrop(" << c.size << ")");
    CHECK(std::equal(ours.begin(), ours.end(), expected.begin() + static_cast<std::ptrdiff_t>(at)));
    at += static_cast<size_t>(bytes);
  }
  CHECK(at == expected.size());
}

TEST_CASE("a CMYK JPEG decodes to Pillow's convert(\"RGB\"), whole and as a crop's region") {
  if (std::system("/usr/bin/python3 -c 'import PIL' 2>/dev/null") != 0) {
    mtrain::testing::skip_test_binary("/usr/bin/python3 has no PIL (Debian's python3-pil)");
  }
  mtrain::testing::TempDir dir;
  // Pillow writes the CMYK JPEG (Adobe's inverted convention) and its RGB bytes, HWC.
  const std::string script = fmt::format(
      "from PIL import Image\n"
      "im = Image.new('CMYK', (90, 70))\n"
      "im.putdata([((x * 3) % 256, (y * 5) % 256, (x * y) % 256, (x + y) % 200) for y in range(70) for x in range(90)])\n"
      "im.save('{0}/c.jpg', quality=92)\n"
      "open('{0}/rgb.bin', 'wb').write(Image.open('{0}/c.jpg').convert('RGB').tobytes())\n",
      dir.path().string());
  {
    std::ofstream(dir.file("make.py")) << script;
  }
  REQUIRE(std::system(fmt::format("/usr/bin/python3 '{}'", dir.file("make.py")).c_str()) == 0);
  std::ifstream expected_file(dir.file("rgb.bin"), std::ios::binary);
  const std::vector<uint8_t> expected{std::istreambuf_iterator<char>(expected_file), {}};
  const DecodedImage whole = decode_image(dir.path() / "c.jpg");
  REQUIRE(whole.channels == 3);
  CHECK(whole.pixels == expected);
  // The region path (libjpeg's API) gives the same bytes for a crop.
  std::ifstream in(dir.file("c.jpg"), std::ios::binary);
  const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in), {}};
  const ImageTransform t{ImageTransform::Kind::kRandomResizedCrop, 24, 24, 0, 5};
  for (int64_t index = 0; index < 6; ++index) {
    std::vector<uint8_t> region(3 * 24 * 24), full(3 * 24 * 24);
    decode_to_chw("c.jpg", bytes.data(), bytes.size(), t, 0, index, 3, region.data());
    transform_to_chw(whole, t, 0, index, 3, full.data());
    CHECK(region == full);
  }
}
