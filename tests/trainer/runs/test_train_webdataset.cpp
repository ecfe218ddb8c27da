// End to end over WebDataset shards: an image folder of JPEGs and PNGs of mixed sizes packed
// by mtrain-pack, then trained by 2 ranks through mtrain-launch, each reading its own
// shards; a run stopped and resumed in the same world ends with the uninterrupted run's
// weights, and an epoch carried through three worlds reads each sample once; and what a
// user can get wrong gets its message.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/tar.h"
#include "tests/data/image_files.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/metrics_events.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "tests/trainer/weights_compare.h"

using Catch::Matchers::Contains;
using mtrain::testing::concat;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kPack = mtrain::testing::bin_dir() + "/mtrain-pack";

// Three classes told apart by colour, each image its own size (12 to 40 pixels a side),
// every third a PNG: 24 training and 8 evaluation images a class.
void write_photos(const fs::path& root) {
  const uint8_t colours[3][3] = {{210, 50, 40}, {40, 190, 60}, {50, 60, 220}};
  int n = 0;
  for (const auto& [split, count] : {std::pair{"train", 24}, {"val", 8}}) {
    for (int c = 0; c < 3; ++c) {
      const fs::path dir = root / split / fmt::format("class{}", c);
      fs::create_directories(dir);
      for (int i = 0; i < count; ++i, ++n) {
        const int64_t h = 12 + (n * 7) % 29, w = 12 + (n * 11) % 29;
        std::vector<uint8_t> pixels;
        for (int64_t p = 0; p < h * w; ++p) {
          for (int k = 0; k < 3; ++k) pixels.push_back(static_cast<uint8_t>(colours[c][k] + (p * 13 + k * 7) % 31 - 15));
        }
        if (i % 3 == 0) {
          mtrain::testing::write_png(dir / fmt::format("{}.png", i), h, w, 3, pixels);
        } else {
          mtrain::testing::write_jpeg(dir / fmt::format("{}.jpg", i), h, w, 3, pixels, 90);
        }
      }
    }
  }
}

void require_success(const ProcessResult& r) {
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
}

// Packed once for the whole binary: 72 training samples in 6 shards of 12, 24 to evaluate.
const fs::path& shards() {
  static TempDir dir;
  static const fs::path packed = [] {
    write_photos(dir.path() / "photos");
    require_success(mtrain::testing::run_process(
        kPack, {"--from", dir.file("photos"), "--to", dir.file("shards"), "--shard-size", "12"}));
    return dir.path() / "shards";
  }();
  return packed;
}

const fs::path photos() { return shards().parent_path() / "photos"; }

std::vector<std::string> base() {
  return {"--model", "simplecnn", "--dataset", "webdataset", "--data-dir", shards().string(), "--random-resized-crop",
          "16", "--random-flip", "--batch-size", "8", "--lr", "0.05", "--threads", "1", "--loader-workers", "2"};
}

ProcessResult launch(int nproc, const std::vector<std::string>& args) {
  return mtrain::testing::run_process(mtrain::testing::kLauncher,
                                      concat({fmt::format("--nproc_per_node={}", nproc), "train"}, args));
}

// train/ and val/, one shard each of 6 samples 000-005, labels i % 2; image 003 is a JPEG's
// first bytes and nothing more.
fs::path write_broken_shards(const TempDir& dir) {
  const fs::path broken = dir.path() / "broken";
  fs::create_directories(broken / "train");
  fs::create_directories(broken / "val");
  for (const char* split : {"train", "val"}) {
    mtrain::data::TarWriter tar(broken / split / "s-0.tar");
    for (int i = 0; i < 6; ++i) {
      std::vector<uint8_t> image;
      if (i == 3) {
        image.assign({0xFF, 0xD8, 0xFF, 0xE0, 1, 2, 3});  // a JPEG's first bytes, then nothing
      } else {
        const std::string png = dir.file("p.png");
        mtrain::testing::write_png(png, 9, 9, 3, std::vector<uint8_t>(243, static_cast<uint8_t>(40 * i)));
        std::ifstream in(png, std::ios::binary);
        image.assign(std::istreambuf_iterator<char>(in), {});
      }
      tar.add(fmt::format("{:03}.jpg", i), image);
      const std::string label = std::to_string(i % 2);
      tar.add(fmt::format("{:03}.cls", i), std::vector<uint8_t>(label.begin(), label.end()));
    }
    tar.finish();
  }
  return broken;
}

}  // namespace

TEST_CASE("2 ranks learn from packed shards, each reading its own", "[e2e]") {
  TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  const ProcessResult r = launch(2, concat(base(), {"--epochs", "4", "--metrics", metrics}));
  require_success(r);
  CHECK_THAT(r.out, Contains("train set: webdataset/train: 72 images 3x16x16, 3 classes (6 WebDataset shard(s)"));
  CHECK_THAT(r.out, Contains("test set: webdataset/val: 24 images 3x16x16"));
  CHECK_THAT(r.out, Contains("rank 0 of 2 reads its own shards (3 of 6 this epoch) through a shuffle buffer of 1000"));
  const auto epochs = mtrain::testing::read_events(metrics, "epoch");
  REQUIRE(epochs.size() == 4);
  CHECK(epochs.back()["images"] == 72);  // 36 a rank: the shards split evenly
  INFO("test accuracy " << epochs.back()["test_acc"]);
  CHECK(epochs.back()["test_acc"].get<double>() >= 0.9);
}

TEST_CASE("an image folder given a crop is read per batch, as torchvision's ImageFolder reads it", "[e2e]") {
  TempDir dir;
  const std::string metrics = dir.file("m.jsonl");
  const ProcessResult r = mtrain::testing::run_process(
      mtrain::testing::kTrainer, {"--model", "simplecnn", "--dataset", "imagefolder", "--data-dir", photos().string(),
                                  "--random-resized-crop", "16", "--random-flip", "--batch-size", "8", "--lr", "0.05",
                                  "--threads", "1", "--epochs", "3", "--metrics", metrics});
  require_success(r);
  CHECK_THAT(r.out, Contains("train set: imagefolder/train: 72 images 3x16x16, 3 classes (image folder") &&
                        Contains("read per batch"));
  CHECK_THAT(r.out, Contains("distributed shard 0 of 1"));  // files are read in any order: no shard sampler
  const auto epochs = mtrain::testing::read_events(metrics, "epoch");
  REQUIRE(epochs.size() == 3);
  CHECK(epochs.back()["test_acc"].get<double>() >= 0.9);
}

TEST_CASE("a run stopped mid-epoch and resumed in its world ends with the uninterrupted run's weights", "[e2e]") {
  TempDir dir;
  const auto args = concat(base(), {"--epochs", "2", "--checkpoint-dir", dir.file("ckpt")});
  require_success(launch(2, concat(base(), {"--epochs", "2", "--save-final", dir.file("whole.safetensors")})));
  require_success(launch(2, concat(args, {"--max-steps", "3"})));  // epoch 1 has 5 steps
  const ProcessResult resumed = launch(2, concat(args, {"--save-final", dir.file("resumed.safetensors")}));
  require_success(resumed);
  CHECK_THAT(resumed.out, Contains("epoch 1 stopped by --max-steps after 3 of its 5 steps"));
  const auto d = mtrain::testing::compare_weights(dir.file("whole.safetensors"), dir.file("resumed.safetensors"));
  INFO(d.describe());
  CHECK(d.identical());

}

TEST_CASE("an epoch begun on 2 ranks, continued on 3, ends on 1 with every sample once", "[e2e][elastic]") {
  // Note [An epoch of shards in several worlds]: 2 ranks x 4 take 3 steps (24 samples), 3 ranks
  // x 4 take 2 (24 more, of those left), and one rank takes the last 24, none of them twice.
  TempDir dir;
  const auto args = concat(base(), {"--batch-size", "4", "--no-eval", "--checkpoint-dir", dir.file("ckpt"), "--metrics",
                                    dir.file("m.jsonl")});
  require_success(launch(2, concat(args, {"--max-steps", "3"})));
  const ProcessResult three = launch(3, concat(args, {"--max-steps", "5"}));
  require_success(three);
  CHECK_THAT(three.out, Contains("world 2 -> 3: the checkpoint's 2 rank(s) took 24 of epoch 1's items in 3 step(s)"));
  const ProcessResult one = launch(1, concat(args, {"--epochs", "1"}));
  require_success(one);
  CHECK_THAT(one.out, Contains("world 3 -> 1: the checkpoint's 3 rank(s) took 48 of epoch 1's items in 5 step(s)"));
  const auto epochs = mtrain::testing::read_events(dir.file("m.jsonl"), "epoch");
  REQUIRE(epochs.size() == 3);
  CHECK(epochs[0]["images"] == 24);
  CHECK(epochs[1]["images"] == 24);
  CHECK(epochs[2]["images"] == 24);  // one rank: no padding, the 24 the others left
  CHECK(epochs[2]["step"] == 5 + 6);
  // The checkpoint after the epoch's end starts the next epoch whole, in any world.
  require_success(launch(2, concat(args, {"--epochs", "2"})));
  const auto after = mtrain::testing::read_events(dir.file("m.jsonl"), "epoch");
  REQUIRE(after.size() == 4);
  CHECK(after[3]["images"] == 72);
}

TEST_CASE("webdataset: what a user can get wrong is named", "[e2e]") {
  TempDir dir;
  const auto train = [](const std::vector<std::string>& args) {
    return mtrain::testing::run_process(mtrain::testing::kTrainer, concat(args, {"--threads", "1", "--max-steps", "1"}));
  };
  const std::vector<std::string> plain = {"--model", "simplecnn", "--dataset", "webdataset", "--data-dir",
                                          shards().string()};
  const auto fails_with = [&](const std::vector<std::string>& args, const std::string& message) {
    const ProcessResult r = train(args);
    INFO("stderr:\n" << r.err);
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.err, Contains(message));
  };
  fails_with(plain, "its images come in any size; give the training images' transform");
  fails_with(concat(plain, {"--random-resized-crop", "16", "--normalize", "auto"}), "--normalize auto computes");
  fails_with(concat(plain, {"--center-crop", "16", "--resize", "20x20"}), "give --resize as one number");
  fails_with({"--model", "simplecnn", "--dataset", "webdataset", "--data-dir",
              (shards() / "train" / "train-{000000..000009}.tar").string(), "--resize", "16"},
             "4 of its 10 shard(s) are missing");
  fails_with({"--model", "simplecnn", "--dataset", "webdataset", "--data-dir", (shards() / "train").string(), "--resize",
              "16"},
             "give --val-data, or --no-eval");
  fails_with({"--model", "simplecnn", "--random-resized-crop", "16"}, "--random-resized-crop applies to --dataset webdataset");

  // An image that does not decode, found when its batch is assembled: named, or left out.
  const fs::path broken = write_broken_shards(dir);
  const std::vector<std::string> on_broken = {"--model", "simplecnn", "--dataset", "webdataset", "--data-dir",
                                              broken.string(), "--resize", "8", "--batch-size", "6", "--no-shuffle"};
  fails_with(on_broken, "s-0.tar: 003.jpg: not a readable JPEG");
  const ProcessResult skipped = train(concat(on_broken, {"--skip-bad-images"}));
  INFO("stderr:\n" << skipped.err);
  CHECK(skipped.exit_code == 0);
  CHECK_THAT(skipped.out + skipped.err, Contains("training image(s) of rank 0 did not decode and were left out") &&
                                            Contains("s-0.tar: 003.jpg"));
}

TEST_CASE("a run resumed mid-epoch reads none of the batches it passes over", "[e2e]") {
  // The broken image 003 is in the second batch of 2 (no shuffle): the first run's second step
  // leaves it out; the resumed run starts at the third batch and never decodes it.
  TempDir dir;
  const fs::path broken = write_broken_shards(dir);
  const std::vector<std::string> args = {
      "--model",      "simplecnn", "--dataset",  "webdataset", "--data-dir", broken.string(), "--resize", "8",
      "--batch-size", "2",         "--no-shuffle", "--no-eval", "--epochs",  "1",             "--threads", "1",
      "--skip-bad-images", "--checkpoint-dir", dir.file("ckpt")};
  const ProcessResult first = mtrain::testing::run_process(mtrain::testing::kTrainer, concat(args, {"--max-steps", "2"}));
  require_success(first);
  CHECK_THAT(first.out + first.err, Contains("1 training image(s) of rank 0 did not decode"));
  const ProcessResult resumed = mtrain::testing::run_process(mtrain::testing::kTrainer, args);
  require_success(resumed);
  CHECK_THAT(resumed.out, Contains("resuming from"));
  CHECK_THAT(resumed.out + resumed.err, !Contains("did not decode"));
}

TEST_CASE("mtrain-pack --index writes shards' index files; a run says when one is out of date", "[e2e]") {
  TempDir dir;
  // The packed training shards copied without their index files, as shards made elsewhere.
  const fs::path copy = dir.path() / "copy";
  fs::create_directories(copy);
  for (const auto& entry : fs::directory_iterator(shards() / "train")) {
    if (entry.path().extension() == ".tar") fs::copy_file(entry.path(), copy / entry.path().filename());
  }
  const auto train = [&] {
    const ProcessResult r = mtrain::testing::run_process(
        mtrain::testing::kTrainer, {"--model", "simplecnn", "--dataset", "webdataset", "--data-dir", copy.string(),
                                    "--resize", "16", "--no-eval", "--threads", "1", "--max-steps", "1"});
    require_success(r);
    return r.out + r.err;
  };
  CHECK_THAT(train(), !Contains("index file"));  // none: the headers are listed, nothing to say
  // The packer's index files beside shards copied after them (cp without -p): out of date, said so.
  for (const auto& entry : fs::directory_iterator(shards() / "train")) {
    if (entry.path().extension() == ".idx") fs::copy_file(entry.path(), copy / entry.path().filename());
  }
  CHECK_THAT(train(), Contains("6 of webdataset/train's 6 shard index file(s) not used, the shards' headers listed "
                               "instead (`mtrain-pack --index` writes them again)"));
  const ProcessResult indexed = mtrain::testing::run_process(kPack, {"--index", copy.string()});
  require_success(indexed);
  CHECK_THAT(indexed.out, Contains("mtrain-pack: indexed 72 samples in 6 shard(s)"));
  CHECK_THAT(train(), !Contains("index file"));
  // One shard changed since: only its index is passed over.
  fs::last_write_time(copy / "train-000000.tar", fs::last_write_time(copy / "train-000000.tar") + std::chrono::hours(1));
  CHECK_THAT(train(), Contains("1 of webdataset/train's 6 shard index file(s) not used") &&
                          Contains("train-000000.tar.mtrain.idx: made for"));

  const ProcessResult both = mtrain::testing::run_process(kPack, {"--index", copy.string(), "--to", dir.file("x")});
  CHECK(both.exit_code == 2);
  CHECK_THAT(both.err, Contains("--index indexes shards that exist: expected it without --from, --to"));
  const ProcessResult missing =
      mtrain::testing::run_process(kPack, {"--index", (copy / "train-{000000..000007}.tar").string()});
  CHECK(missing.exit_code != 0);
  CHECK_THAT(missing.err, Contains("--index " + (copy / "train-{000000..000007}.tar").string() +
                                   ": 2 of its 8 shard(s) are missing"));
}
