// The shipped mini set must be a faithful prefix of the official Fashion-MNIST files.
// The official files are not part of the product; they are read from the shared
// dataset folder beside the checkout when it exists, and the binary skips otherwise.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>

#include "data/idx_reader.h"
#include "tests/support/skip.h"

using namespace mtrain::data;

namespace {

const std::filesystem::path kMiniDir =
    std::filesystem::path(MTRAIN_SOURCE_DIR) / "data" / "fashion-mnist-mini";
const std::filesystem::path kOfficialDir =
    std::filesystem::path(MTRAIN_SOURCE_DIR "/../shared/datasets") / "fashion-mnist";

// Runs before Catch2's main: the whole binary is about the official files.
const bool kOfficialPresent = [] {
  if (!find_idx_file(kOfficialDir, kIdxTrainImages) ||
      !find_idx_file(kOfficialDir, kIdxTestLabels)) {
    mtrain::testing::skip_test_binary(
        "official Fashion-MNIST files not found at ../shared/datasets/fashion-mnist");
  }
  return true;
}();

}  // namespace

TEST_CASE("Mini set labels are the official first labels", "[data][mini]") {
  REQUIRE(kOfficialPresent);
  for (const auto& [stem, count] : {std::pair{kIdxTrainLabels, 6000}, std::pair{kIdxTestLabels, 1000}}) {
    const auto mini = read_idx_labels(*find_idx_file(kMiniDir, stem), 10);
    const auto official = read_idx_labels(*find_idx_file(kOfficialDir, stem), 10);
    REQUIRE(mini.size() == static_cast<size_t>(count));
    REQUIRE(official.size() > mini.size());
    CHECK(std::equal(mini.begin(), mini.end(), official.begin()));
  }
}

TEST_CASE("Mini set images are the official first images", "[data][mini]") {
  REQUIRE(kOfficialPresent);
  const IdxImages mini = read_idx_images(*find_idx_file(kMiniDir, kIdxTestImages));
  const IdxImages official = read_idx_images(*find_idx_file(kOfficialDir, kIdxTestImages));
  REQUIRE(mini.count == 1000);
  REQUIRE(mini.rows == official.rows);
  REQUIRE(mini.cols == official.cols);
  CHECK(std::equal(mini.pixels.begin(), mini.pixels.end(), official.pixels.begin()));

  const IdxImages mini_train = read_idx_images(*find_idx_file(kMiniDir, kIdxTrainImages));
  const IdxImages official_train = read_idx_images(*find_idx_file(kOfficialDir, kIdxTrainImages));
  REQUIRE(mini_train.count == 6000);
  // The first image on its own, so a failure says whether the start is already wrong.
  const size_t image_bytes = 28 * 28;
  CHECK(std::equal(mini_train.pixels.begin(), mini_train.pixels.begin() + image_bytes,
                   official_train.pixels.begin()));
  CHECK(std::equal(mini_train.pixels.begin(), mini_train.pixels.end(),
                   official_train.pixels.begin()));
}
