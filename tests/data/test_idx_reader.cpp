#include <catch2/catch.hpp>

#include <filesystem>
#include <functional>
#include <string>

#include "core/error.h"
#include "data/idx_reader.h"
#include "tests/data/idx_fixtures.h"

using namespace mtrain;
using namespace mtrain::data;
using mtrain::testing::ScratchDir;
using Catch::Matchers::Contains;

namespace {

// The IoError message `fn` throws; fails the test if it throws nothing or another type.
std::string io_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const IoError& e) {
    return e.what();
  }
  FAIL("expected an IoError");
  return {};
}

}  // namespace

TEST_CASE("IDX images: raw and gzip files read back exactly", "[data][idx]") {
  ScratchDir dir;
  const auto bytes = mtrain::testing::idx_images_bytes(3, 4, 5);
  mtrain::testing::write_raw(dir / "raw-images", bytes);
  mtrain::testing::write_gzip(dir / "images.gz", bytes);

  for (const char* name : {"raw-images", "images.gz"}) {
    const IdxImages images = read_idx_images(dir / name);
    CHECK(images.count == 3);
    CHECK(images.rows == 4);
    CHECK(images.cols == 5);
    REQUIRE(images.pixels.size() == 60);
    CHECK(std::equal(images.pixels.begin(), images.pixels.end(), bytes.begin() + 16));
  }
}

TEST_CASE("IDX: gzip is detected by its magic, not by the file name", "[data][idx]") {
  ScratchDir dir;
  const auto bytes = mtrain::testing::idx_images_bytes(2, 3, 3);
  mtrain::testing::write_gzip(dir / "compressed-without-suffix", bytes);
  mtrain::testing::write_raw(dir / "raw-with-suffix.gz", bytes);
  CHECK(read_idx_images(dir / "compressed-without-suffix").pixels.size() == 18);
  CHECK(read_idx_images(dir / "raw-with-suffix.gz").pixels.size() == 18);
}

TEST_CASE("IDX labels: read and widened to int64", "[data][idx]") {
  ScratchDir dir;
  mtrain::testing::write_gzip(dir / "labels.gz", mtrain::testing::idx_labels_bytes({9, 0, 3, 7}));
  CHECK(read_idx_labels(dir / "labels.gz", 10) == std::vector<int64_t>{9, 0, 3, 7});
}

TEST_CASE("IDX: truncated payloads are rejected with what was promised", "[data][idx]") {
  ScratchDir dir;
  auto bytes = mtrain::testing::idx_images_bytes(3, 4, 5);
  bytes.resize(bytes.size() - 7);

  SECTION("raw file") {
    mtrain::testing::write_raw(dir / "short", bytes);
    const std::string msg = io_error_of([&] { read_idx_images(dir / "short"); });
    CHECK_THAT(msg, Contains((dir / "short").string()));
    CHECK_THAT(msg, Contains("truncated"));
    CHECK_THAT(msg, Contains("3 images of 4x5 (60 bytes after the header)"));
    CHECK_THAT(msg, Contains("found only 53 bytes"));
  }
  SECTION("gzip of a short payload") {
    mtrain::testing::write_gzip(dir / "short.gz", bytes);
    const std::string msg = io_error_of([&] { read_idx_images(dir / "short.gz"); });
    CHECK_THAT(msg, Contains("truncated"));
    CHECK_THAT(msg, Contains("found only 53 bytes"));
  }
  SECTION("gzip stream cut off (half-downloaded file)") {
    ScratchDir src;
    mtrain::testing::write_gzip(src / "full.gz", mtrain::testing::idx_images_bytes(50, 28, 28));
    auto gz = mtrain::testing::read_bytes(src / "full.gz");
    gz.resize(gz.size() / 2);
    mtrain::testing::write_raw(dir / "cut.gz", gz);
    const std::string msg = io_error_of([&] { read_idx_images(dir / "cut.gz"); });
    CHECK_THAT(msg, Contains("truncated"));
    CHECK_THAT(msg, Contains("50 images of 28x28"));
    CHECK_THAT(msg, Contains("gzip stream itself is cut off"));
  }
  SECTION("gzip stream cut off in its trailer: every pixel is there, but unchecked") {
    ScratchDir src;
    mtrain::testing::write_gzip(src / "full.gz", mtrain::testing::idx_images_bytes(3, 4, 5));
    const auto gz = mtrain::testing::read_bytes(src / "full.gz");
    for (size_t cut : {1, 4, 8}) {  // the trailer is CRC32 then length, 4 bytes each
      INFO("last " << cut << " bytes removed");
      auto shorter = gz;
      shorter.resize(gz.size() - cut);
      mtrain::testing::write_raw(dir / "no-trailer.gz", shorter);
      const std::string msg = io_error_of([&] { read_idx_images(dir / "no-trailer.gz"); });
      CHECK_THAT(msg, Contains("truncated: the gzip stream ends before its 8-byte CRC"));
    }
  }
  SECTION("shorter than the header") {
    mtrain::testing::write_raw(dir / "tiny", {0, 0, 8, 3, 0, 0});
    const std::string msg = io_error_of([&] { read_idx_images(dir / "tiny"); });
    CHECK_THAT(msg, Contains("expected a 16-byte images header, found only 6 bytes"));
  }
  SECTION("labels") {
    auto labels = mtrain::testing::idx_labels_bytes({1, 2, 3, 4});
    labels.pop_back();
    mtrain::testing::write_raw(dir / "labels", labels);
    const std::string msg = io_error_of([&] { read_idx_labels(dir / "labels", 10); });
    CHECK_THAT(msg, Contains("4 labels (4 bytes after the header), found only 3 bytes"));
  }
}

TEST_CASE("IDX: corrupt gzip data is rejected, naming how far it decompressed", "[data][idx]") {
  ScratchDir dir;
  // Random pixels do not compress: deflate stores them, so a flipped byte changes the
  // data without breaking the stream's structure, and only the CRC can notice.
  auto bytes = mtrain::testing::idx_images_bytes(12000, 28, 28);
  uint32_t state = 12345;
  for (size_t i = 16; i < bytes.size(); ++i) {
    state = state * 1664525u + 1013904223u;
    bytes[i] = static_cast<uint8_t>(state >> 24);
  }
  ScratchDir src;
  mtrain::testing::write_gzip(src / "good.gz", bytes);
  auto gz = mtrain::testing::read_bytes(src / "good.gz");
  gz[gz.size() * 3 / 4] ^= 0x10;
  mtrain::testing::write_raw(dir / "bad.gz", gz);
  const std::string msg = io_error_of([&] { read_idx_images(dir / "bad.gz"); });
  CHECK_THAT(msg, Contains("corrupt gzip data after"));
  CHECK_THAT(msg, !Contains("after 0 decompressed bytes"));
}

TEST_CASE("IDX: trailing bytes are rejected with the count of extra bytes", "[data][idx]") {
  ScratchDir dir;
  auto bytes = mtrain::testing::idx_images_bytes(2, 3, 3);
  bytes.insert(bytes.end(), {1, 2, 3});
  mtrain::testing::write_gzip(dir / "long.gz", bytes);
  const std::string msg = io_error_of([&] { read_idx_images(dir / "long.gz"); });
  CHECK_THAT(msg, Contains("trailing bytes"));
  CHECK_THAT(msg, Contains("2 images of 3x3 (18 bytes after the header), found 21 bytes (3 extra)"));

  auto labels = mtrain::testing::idx_labels_bytes({1, 2});
  labels.push_back(0);
  mtrain::testing::write_raw(dir / "labels", labels);
  CHECK_THAT(io_error_of([&] { read_idx_labels(dir / "labels", 10); }), Contains("(1 extra)"));
}

TEST_CASE("IDX: wrong magic names the expected and the found kind", "[data][idx]") {
  ScratchDir dir;
  mtrain::testing::write_raw(dir / "labels-as-images", mtrain::testing::idx_labels_bytes({1, 2}));
  CHECK_THAT(io_error_of([&] { read_idx_images(dir / "labels-as-images"); }),
             Contains("expected magic 0x00000803 (images), found 0x00000801 (a labels file)"));

  mtrain::testing::write_raw(dir / "images-as-labels", mtrain::testing::idx_images_bytes(1, 2, 2));
  CHECK_THAT(io_error_of([&] { read_idx_labels(dir / "images-as-labels", 10); }),
             Contains("expected magic 0x00000801 (labels), found 0x00000803 (an images file)"));

  mtrain::testing::write_raw(dir / "text", {'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l',
                                            'd', '!', '!', '!', '!', '!'});
  CHECK_THAT(io_error_of([&] { read_idx_images(dir / "text"); }),
             Contains("found 0x68656c6c (not an IDX uint8 file)"));
}

TEST_CASE("IDX: zero or absurd dimensions and counts are rejected", "[data][idx]") {
  ScratchDir dir;
  mtrain::testing::write_raw(dir / "zero-rows", mtrain::testing::idx_images_bytes(2, 0, 28));
  CHECK_THAT(io_error_of([&] { read_idx_images(dir / "zero-rows"); }),
             Contains("expected image dimensions in [1, 4096] (28x28 for MNIST), found 0x28"));

  // Only the header: the dimension check must come before any attempt to read pixels.
  std::vector<uint8_t> huge;
  mtrain::testing::append_be32(huge, 0x00000803);
  mtrain::testing::append_be32(huge, 1);
  mtrain::testing::append_be32(huge, 28);
  mtrain::testing::append_be32(huge, 100000);
  mtrain::testing::write_raw(dir / "huge-cols", huge);
  CHECK_THAT(io_error_of([&] { read_idx_images(dir / "huge-cols"); }), Contains("found 28x100000"));

  mtrain::testing::write_raw(dir / "no-items", mtrain::testing::idx_images_bytes(0, 28, 28));
  CHECK_THAT(io_error_of([&] { read_idx_images(dir / "no-items"); }),
             Contains("expected an item count in [1, 1000000000], found 0"));

  // A header promising a billion images over a 20-byte file is a truncation, found
  // without allocating the promised 784 GB.
  std::vector<uint8_t> liar;
  mtrain::testing::append_be32(liar, 0x00000803);
  mtrain::testing::append_be32(liar, 1000000000);
  mtrain::testing::append_be32(liar, 28);
  mtrain::testing::append_be32(liar, 28);
  mtrain::testing::append_be32(liar, 0);
  mtrain::testing::write_raw(dir / "liar", liar);
  CHECK_THAT(io_error_of([&] { read_idx_images(dir / "liar"); }), Contains("found only 4 bytes"));
}

TEST_CASE("IDX: labels outside [0, num_classes) are rejected", "[data][idx]") {
  ScratchDir dir;
  mtrain::testing::write_raw(dir / "labels", mtrain::testing::idx_labels_bytes({0, 9, 10, 3}));
  CHECK_THAT(io_error_of([&] { read_idx_labels(dir / "labels", 10); }),
             Contains("label of item 2 is 10, expected [0, 9]"));
  CHECK(read_idx_labels(dir / "labels", 11).size() == 4);
}

TEST_CASE("IDX: a missing file is an IoError naming it", "[data][idx]") {
  ScratchDir dir;
  CHECK_THAT(io_error_of([&] { read_idx_images(dir / "absent.gz"); }),
             Contains("absent.gz: expected a regular file, found nothing (no such file)"));
}

TEST_CASE("IDX dataset: image and label counts must match", "[data][idx]") {
  ScratchDir dir;
  mtrain::testing::write_gzip(dir / "images.gz", mtrain::testing::idx_images_bytes(3, 28, 28));
  mtrain::testing::write_gzip(dir / "labels.gz", mtrain::testing::idx_labels_bytes({1, 2}));
  const std::string msg =
      io_error_of([&] { load_idx_dataset(dir / "images.gz", dir / "labels.gz", "t", 10); });
  CHECK_THAT(msg, Contains("found 3 images in"));
  CHECK_THAT(msg, Contains("and 2 labels in"));

  mtrain::testing::write_gzip(dir / "labels.gz", mtrain::testing::idx_labels_bytes({1, 2, 7}));
  const Dataset ds = load_idx_dataset(dir / "images.gz", dir / "labels.gz", "t/train", 10);
  CHECK(ds.size() == 3);
  CHECK(ds.shape() == ImageShape{1, 28, 28});
  CHECK(ds.label(2) == 7);
  CHECK(ds.image(1)[0] == 7);  // pixel (i, k) = 7i + k in the fixture
  CHECK(ds.name() == "t/train");
}

TEST_CASE("IDX splits: a directory missing files lists them", "[data][idx]") {
  ScratchDir dir;
  mtrain::testing::write_gzip(dir / "train-images-idx3-ubyte.gz",
                              mtrain::testing::idx_images_bytes(2, 28, 28));
  mtrain::testing::write_raw(dir / "train-labels-idx1-ubyte", mtrain::testing::idx_labels_bytes({1, 2}));
  const std::string msg = io_error_of([&] { load_idx_splits(dir.path(), "mnist"); });
  CHECK_THAT(msg, Contains("missing t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]"));
  CHECK_THAT(msg, !Contains("train-images") && !Contains("train-labels"));

  mtrain::testing::write_gzip(dir / "t10k-images-idx3-ubyte.gz",
                              mtrain::testing::idx_images_bytes(1, 28, 28));
  mtrain::testing::write_gzip(dir / "t10k-labels-idx1-ubyte.gz", mtrain::testing::idx_labels_bytes({5}));
  const DatasetSplits splits = load_idx_splits(dir.path(), "mnist");
  CHECK(splits.train.size() == 2);
  CHECK(splits.test.size() == 1);
  CHECK(splits.test.label(0) == 5);
  CHECK(splits.test.name() == "mnist/test");
}

TEST_CASE("Shipped fashion-mnist-mini loads with 6000 train and 1000 test images",
          "[data][idx][mini]") {
  const DatasetSplits splits =
      load_idx_splits(std::filesystem::path(MTRAIN_SOURCE_DIR) / "data" / "fashion-mnist-mini",
                      "fashion-mnist");
  CHECK(splits.train.size() == 6000);
  CHECK(splits.test.size() == 1000);
  CHECK(splits.train.shape() == ImageShape{1, 28, 28});
  CHECK(splits.test.shape() == ImageShape{1, 28, 28});
  // Every class is present in both slices (the README states the exact balance).
  for (const Dataset* ds : {&splits.train, &splits.test}) {
    std::vector<int64_t> counts(10, 0);
    for (int64_t label : ds->labels()) ++counts[static_cast<size_t>(label)];
    for (int64_t c : counts) CHECK(c > ds->size() / 20);
  }
}
