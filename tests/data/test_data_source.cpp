#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <functional>

#include "core/error.h"
#include "data/data_source.h"
#include "data/idx_reader.h"
#include "tests/data/idx_fixtures.h"
#include "tests/support/error_of.h"

using namespace mtrain;
using namespace mtrain::data;
using mtrain::testing::ScratchDir;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;
using mtrain::testing::error_of;

namespace {

const fs::path kShippedData = fs::path(MTRAIN_SOURCE_DIR) / "data";

// Four tiny but valid IDX files under the official names.
void write_idx_set(const fs::path& dir, uint8_t first_label) {
  fs::create_directories(dir);
  mtrain::testing::write_gzip(dir / "train-images-idx3-ubyte.gz",
                              mtrain::testing::idx_images_bytes(2, 28, 28));
  mtrain::testing::write_gzip(dir / "train-labels-idx1-ubyte.gz",
                              mtrain::testing::idx_labels_bytes({first_label, 1}));
  mtrain::testing::write_raw(dir / "t10k-images-idx3-ubyte", mtrain::testing::idx_images_bytes(1, 28, 28));
  mtrain::testing::write_raw(dir / "t10k-labels-idx1-ubyte", mtrain::testing::idx_labels_bytes({4}));
}

}  // namespace

TEST_CASE("resolve_data_dir: --data-dir is used as given", "[data][source]") {
  ScratchDir scratch;
  write_idx_set(scratch / "mine", 8);
  const DataSource src = resolve_data_dir("mnist", (scratch / "mine").string(), {});
  CHECK(src.dir == scratch / "mine");
  CHECK(src.dataset == "mnist");
  CHECK_THAT(src.description, Contains("(--data-dir)"));
  const DatasetSplits splits = load_splits(src, {});
  CHECK(splits.train.label(0) == 8);
  CHECK(splits.test.size() == 1);
}

TEST_CASE("resolve_data_dir: --data-dir with missing files lists them", "[data][source]") {
  ScratchDir scratch;
  write_idx_set(scratch / "partial", 0);
  fs::remove(scratch / "partial" / "train-labels-idx1-ubyte.gz");
  fs::remove(scratch / "partial" / "t10k-images-idx3-ubyte");
  const std::string msg = error_of<IoError>(
      [&] { resolve_data_dir("fashion-mnist", (scratch / "partial").string(), {}); });
  CHECK_THAT(msg, Contains("missing train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz]"));
  CHECK_THAT(msg, !Contains("train-images"));

  CHECK_THAT(error_of<IoError>([&] { resolve_data_dir("mnist", (scratch / "nope").string(), {}); }),
             Contains("found no such directory"));
  // A file where the directory should be is not "no such directory".
  const fs::path file = scratch / "partial" / "t10k-labels-idx1-ubyte";
  CHECK_THAT(error_of<IoError>([&] { resolve_data_dir("mnist", file.string(), {}); }),
             Contains("expected a directory with the four mnist IDX files, found a regular file"));
}

TEST_CASE("resolve_data_dir: fashion-mnist falls back to the shipped mini set",
          "[data][source]") {
  ScratchDir scratch;
  const fs::path empty_root = scratch / "cwd-data";
  const fs::path project_root = scratch / "project-data";
  fs::create_directories(empty_root);
  fs::create_directories(project_root);
  fs::create_directory_symlink(kShippedData / "fashion-mnist-mini",
                               project_root / "fashion-mnist-mini");

  const DataSource mini = resolve_data_dir("fashion-mnist", "", {empty_root, project_root});
  CHECK(mini.dir == project_root / "fashion-mnist-mini");
  CHECK_THAT(mini.description, Contains("fashion-mnist-mini"));
  CHECK_THAT(mini.description, Contains("scripts/get-data.sh fashion-mnist"));
  CHECK(load_splits(mini, {}).train.size() == 6000);

  SECTION("an incomplete full set is passed over, and the log says why") {
    write_idx_set(empty_root / "fashion-mnist", 0);
    fs::remove(empty_root / "fashion-mnist" / "t10k-labels-idx1-ubyte");
    const DataSource src = resolve_data_dir("fashion-mnist", "", {empty_root, project_root});
    CHECK(src.dir == project_root / "fashion-mnist-mini");
    CHECK_THAT(src.description, Contains("lacks t10k-labels-idx1-ubyte[.gz]"));
  }
  SECTION("a full set anywhere wins over the mini set") {
    write_idx_set(project_root / "fashion-mnist", 0);
    const DataSource src = resolve_data_dir("fashion-mnist", "", {empty_root, project_root});
    CHECK(src.dir == project_root / "fashion-mnist");
    CHECK_THAT(src.description, Contains("full set"));
  }
  SECTION("the current directory's data/ comes first") {
    write_idx_set(empty_root / "fashion-mnist", 0);
    write_idx_set(project_root / "fashion-mnist", 0);
    CHECK(resolve_data_dir("fashion-mnist", "", {empty_root, project_root}).dir ==
          empty_root / "fashion-mnist");
  }
  SECTION("no mini set either is an error pointing at get-data.sh") {
    CHECK_THAT(error_of<IoError>([&] { resolve_data_dir("fashion-mnist", "", {empty_root}); }),
               Contains("run scripts/get-data.sh fashion-mnist or pass --data-dir"));
  }
}

TEST_CASE("resolve_data_dir: mnist without data/mnist says how to get it", "[data][source]") {
  ScratchDir scratch;
  const std::string msg =
      error_of<IoError>([&] { resolve_data_dir("mnist", "", {scratch / "data"}); });
  CHECK_THAT(msg, Contains("expected data/mnist"));
  CHECK_THAT(msg, Contains("run scripts/get-data.sh mnist or pass --data-dir"));

  write_idx_set(scratch / "data" / "mnist", 2);
  CHECK(resolve_data_dir("mnist", "", {scratch / "data"}).dir == scratch / "data" / "mnist");
}

TEST_CASE("resolve_data_dir: synthetic needs no directory; unknown names are rejected",
          "[data][source]") {
  const DataSource src = resolve_data_dir("synthetic", "", {});
  CHECK(src.dir.empty());
  const DatasetSplits splits = load_splits(src, {.train_size = 20, .test_size = 10, .seed = 0});
  CHECK(splits.train.size() == 20);
  CHECK_THAT(error_of<InvalidArgument>([] { resolve_data_dir("synthetic", "/tmp", {}); }),
             Contains("drop --data-dir"));
  CHECK_THAT(error_of<InvalidArgument>([] { resolve_data_dir("imagenet", "", {}); }),
             Contains("expected one of fashion-mnist, mnist, cifar10, cifar100, imagefolder, webdataset, synthetic, found 'imagenet'"));
}

TEST_CASE("resolve_data_dir: default roots find the project's data/ from the build tree",
          "[data][source]") {
  const std::vector<fs::path> roots = default_data_roots();
  REQUIRE(!roots.empty());
  CHECK(roots.front() == fs::current_path() / "data");
  // The test binary lives in <build>/tests/, so <exe dir>/../../data is the project's
  // data/ when the build tree sits in the project root (build/, build-*/). Elsewhere
  // only the current directory could find it, which this test cannot arrange.
  const fs::path exe_root = fs::read_symlink("/proc/self/exe").parent_path() / ".." / ".." / "data";
  if (!fs::exists(exe_root) || !fs::equivalent(exe_root, kShippedData)) {
    WARN("build tree outside the project root; exe-relative lookup not exercised");
    return;
  }
  CHECK(std::any_of(roots.begin(), roots.end(), [](const fs::path& r) {
    return fs::exists(r) && fs::equivalent(r, kShippedData);
  }));
  const DataSource src = resolve_data_dir("fashion-mnist", "");
  const fs::path found = fs::weakly_canonical(src.dir);
  CHECK((found == fs::weakly_canonical(kShippedData / "fashion-mnist-mini") ||
         found == fs::weakly_canonical(kShippedData / "fashion-mnist")));
}
