// The CIFAR-10/100 binary reader: what it reads, and every malformed file it refuses.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/cifar_reader.h"
#include "data/data_source.h"
#include "tests/data/cifar_fixtures.h"
#include "tests/data/idx_fixtures.h"
#include "tests/support/error_of.h"

using namespace mtrain;
using mtrain::testing::error_of;
using namespace mtrain::data;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

TEST_CASE("cifar10: five training batches and the test batch, in order, as 3x32x32 CHW images") {
  testing::ScratchDir dir;
  testing::write_cifar_dir(dir.path(), "cifar10", 7);
  const DatasetSplits s = load_cifar_splits(dir.path(), "cifar10");
  REQUIRE(s.train.size() == 35);
  REQUIRE(s.test.size() == 7);
  CHECK(s.train.shape() == ImageShape{3, 32, 32});
  CHECK(s.train.num_classes() == 10);
  CHECK(s.train.name() == "cifar10/train");
  // Image 9 is record 2 of data_batch_2.bin (file 1); the test set is file 5.
  CHECK(s.train.label(9) == (2 + 1) % 10);
  for (int64_t b : {0, 1023, 1024, 2047, 3071}) {
    CHECK(s.train.image(9)[b] == testing::cifar_pixel(1, 2, b));
    CHECK(s.test.image(6)[b] == testing::cifar_pixel(5, 6, b));
  }
  CHECK(s.test.label(6) == (6 + 5) % 10);
}

TEST_CASE("cifar100: the fine label is the class, the coarse one is skipped") {
  testing::ScratchDir dir;
  testing::write_cifar_dir(dir.path(), "cifar100", 120);
  const DatasetSplits s = load_cifar_splits(dir.path(), "cifar100");
  REQUIRE(s.train.size() == 120);
  CHECK(s.train.num_classes() == 100);
  CHECK(s.train.label(105) == 5);
  CHECK(s.test.label(3) == 4);
  CHECK(s.train.image(105)[0] == testing::cifar_pixel(0, 105, 0));
}

TEST_CASE("cifar files that are not whole, in range or there are refused, naming the file") {
  testing::ScratchDir dir;
  testing::write_cifar_dir(dir.path(), "cifar10", 4);
  const fs::path batch3 = dir.path() / "data_batch_3.bin";
  SECTION("truncated") {
    fs::resize_file(batch3, 3 * 3073 + 100);
    CHECK_THAT(error_of<IoError>([&] { load_cifar_splits(dir.path(), "cifar10"); }),
               Contains("data_batch_3.bin: expected a whole number of 3073-byte records") &&
                   Contains("9319 bytes (3 records and 100 bytes over)"));
  }
  SECTION("empty") {
    fs::resize_file(batch3, 0);
    CHECK_THAT(error_of<IoError>([&] { load_cifar_splits(dir.path(), "cifar10"); }),
               Contains("data_batch_3.bin: expected a whole number") && Contains("found 0 bytes"));
  }
  SECTION("a label out of range (CIFAR-100's file read as CIFAR-10's)") {
    std::fstream f(batch3, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2 * 3073);
    f.put(static_cast<char>(57));
    f.close();
    CHECK_THAT(error_of<IoError>([&] { load_cifar_splits(dir.path(), "cifar10"); }),
               Contains("data_batch_3.bin: record 2 has label 57, expected 0 to 9 (cifar10 classes)"));
  }
  SECTION("a missing batch") {
    fs::remove(dir.path() / "test_batch.bin");
    CHECK_THAT(error_of<IoError>([&] { load_cifar_splits(dir.path(), "cifar10"); }),
               Contains("expected cifar10's binary files, missing test_batch.bin"));
    CHECK_THAT(error_of<IoError>([&] { resolve_data_dir("cifar10", dir.path().string(), {}); }),
               Contains("missing test_batch.bin"));
  }
}

TEST_CASE("resolve_data_dir finds cifar10 under data/cifar10 or as the archive unpacks") {
  testing::ScratchDir root;
  CHECK_THAT(error_of<IoError>([&] { resolve_data_dir("cifar10", "", {root.path()}); }),
             Contains("expected data/cifar10 or data/cifar-10-batches-bin") && Contains("cs.toronto.edu"));
  testing::write_cifar_dir(root.path() / "cifar-10-batches-bin", "cifar10", 2);
  const DataSource src = resolve_data_dir("cifar10", "", {root.path()});
  CHECK(src.dir == root.path() / "cifar-10-batches-bin");
  const DatasetSplits s = load_splits(src, {});
  CHECK(s.train.size() == 10);
  CHECK(s.test.size() == 2);
}
