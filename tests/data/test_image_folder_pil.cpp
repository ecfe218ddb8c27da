// Image folders against Pillow: the bytes mtrain trains on equal, to the byte, those
// torchvision's ImageFolder hands a model (PIL's open, convert("RGB") and, with --resize,
// resize(BILINEAR)), for PNGs of every colour type and JPEGs, with and without resizing.
// Pillow writes the files and the expected bytes (pil_image_folder.py, Debian's
// python3-pil); the binary skips where /usr/bin/python3 has no PIL.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "data/image_folder.h"
#include "tests/data/idx_fixtures.h"
#include "tests/support/skip.h"

using namespace mtrain::data;
namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Runs the Pillow side into `dir`: the folder and expected-{train,val}.bin.
void pil_folder(const fs::path& dir, int64_t height, int64_t width, bool mixed) {
  if (std::system("/usr/bin/python3 -c 'import PIL' 2>/dev/null") != 0) {
    mtrain::testing::skip_test_binary("/usr/bin/python3 has no PIL (Debian's python3-pil)");
  }
  const std::string command = fmt::format("/usr/bin/python3 {}/tests/data/pil_image_folder.py '{}' {} {} {}",
                                          MTRAIN_SOURCE_DIR, dir.string(), height, width, mixed ? 1 : 0);
  REQUIRE(std::system(command.c_str()) == 0);
}

// Image by image, so a difference names the file's position and its largest error.
void check_split(const Dataset& set, const std::vector<uint8_t>& expected, const std::string& split) {
  const int64_t bytes = set.channels() * set.height() * set.width();
  REQUIRE(set.channels() == 3);
  REQUIRE(static_cast<int64_t>(expected.size()) == set.size() * bytes);
  for (int64_t i = 0; i < set.size(); ++i) {
    int differing = 0, largest = 0;
    for (int64_t k = 0; k < bytes; ++k) {
      const int d = std::abs(static_cast<int>(set.image(i)[k]) - static_cast<int>(expected[static_cast<size_t>(i * bytes + k)]));
      differing += d != 0;
      largest = std::max(largest, d);
    }
    INFO(fmt::format("{} image {}: {} of {} bytes differ, by up to {}", split, i, differing, bytes, largest));
    CHECK(differing == 0);
  }
}

}  // namespace

TEST_CASE("decoded as Pillow decodes: PNGs of every colour type, JPEGs, alpha dropped") {
  mtrain::testing::ScratchDir dir;
  pil_folder(dir.path(), 24, 20, /*mixed=*/false);
  const DatasetSplits s = load_image_folder_splits(dir.path());
  CHECK(s.train.shape() == ImageShape{3, 24, 20});
  CHECK(s.train.size() == 16);
  check_split(s.train, read_bytes(dir.path() / "expected-train.bin"), "train");
  check_split(s.test, read_bytes(dir.path() / "expected-val.bin"), "val");
}

TEST_CASE("--resize gives Pillow's bilinear bytes, shrinking and enlarging") {
  mtrain::testing::ScratchDir dir;
  pil_folder(dir.path(), 24, 20, /*mixed=*/true);
  const DatasetSplits s = load_image_folder_splits(dir.path(), {.height = 24, .width = 20});
  CHECK(s.train.shape() == ImageShape{3, 24, 20});
  check_split(s.train, read_bytes(dir.path() / "expected-train.bin"), "train");
  check_split(s.test, read_bytes(dir.path() / "expected-val.bin"), "val");
}
