// The training the elastic tests change the membership of (tests/trainer/ddp/test_elastic.cpp,
// tests/multihost/test_multihost_partition.cpp): LeNet on the mini set with a global batch
// of 256, checkpointed every 3 steps, and the check that whatever happened to the nodes,
// the weights are those one process trains on the same global batches and every epoch
// trained on each of its images once.
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/metrics_events.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "tests/trainer/weights_compare.h"

namespace mtrain::testing {

// LeNet (sigmoid) with a global batch of 256 on 1, 2 or 3 ranks stays within 3e-7 of one process
// over these 240 steps, well inside kEquivalenceTolerance.
inline constexpr int kElasticSteps = 240;  // 10 epochs of 24 steps (the last of 112 images)

// mtrain-train's flags, writing into `dir`.
inline std::vector<std::string> elastic_training(const TempDir& dir) {
  return {"--model", "lenet", "--no-eval", "--threads", "1", "--data-dir", kMiniSet, "--global-batch-size", "256",
          "--max-steps", std::to_string(kElasticSteps), "--checkpoint-dir", dir.file("ckpt"), "--checkpoint-every", "3",
          "--metrics", dir.file("metrics.jsonl"), "--save-final", dir.file("elastic.safetensors")};
}

inline bool elastic_checkpoint_written(const TempDir& dir) {
  return std::filesystem::exists(dir.file("ckpt/checkpoint.safetensors"));
}

inline void require_exit_0(const ProcessResult& r, const std::string& who) {
  INFO(who << " stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
}

// The weights of one process training the same global batches, and every epoch (its last
// event: work redone after a rollback to a checkpoint logs the epoch again) on all 6000
// images once.
inline void check_elastic_training(const TempDir& dir) {
  const std::string one = dir.file("one.safetensors");
  const ProcessResult r = run_process(
      kTrainer, {"--model", "lenet", "--no-eval", "--threads", "1", "--data-dir", kMiniSet, "--global-batch-size", "256",
                 "--max-steps", std::to_string(kElasticSteps), "--log-level", "warn", "--save-final", one});
  require_exit_0(r, "one process");
  const auto d = compare_weights(dir.file("elastic.safetensors"), one);
  INFO(d.describe());
  CHECK(d.max_abs <= kEquivalenceTolerance);
  std::map<int64_t, int64_t> images;  // epoch -> images of its last event
  for (const auto& e : read_events(dir.file("metrics.jsonl"), "epoch")) {
    images[e.at("epoch").get<int64_t>()] = e.at("images").get<int64_t>();
  }
  REQUIRE(images.size() == 10);
  for (const auto& [epoch, n] : images) {
    INFO("epoch " << epoch);
    CHECK(n == 6000);
  }
}

}  // namespace mtrain::testing
