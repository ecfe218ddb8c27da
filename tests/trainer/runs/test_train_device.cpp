// --device and the GPU numerics flags through the real mtrain-train, on the CPU: what
// CI can check of the GPU path without a GPU. The children run with
// CUDA_VISIBLE_DEVICES set to the empty string, which hides every GPU from the CUDA
// runtime, so these tests mean the same on a machine with GPUs (where --device auto
// would otherwise pick one) as on one without.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "tests/support/scoped_env.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "tests/trainer/weights_compare.h"

using Catch::Matchers::Contains;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;

namespace {

using mtrain::testing::ScopedEnv;

ProcessResult train(std::vector<std::string> args) {
  const ScopedEnv no_gpus("CUDA_VISIBLE_DEVICES", "");
  args.insert(args.end(), {"--threads", "1", "--data-dir", mtrain::testing::kMiniSet});
  return mtrain::testing::run_process(mtrain::testing::kTrainer, args);
}

void require_success(const ProcessResult& r) {
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
}

// A few momentum steps of mlp with the test evaluation: enough for every layer's weights
// to move and for any change in the arithmetic to show in their bits.
std::vector<std::string> short_run(const std::string& weights, const std::string& seed = "5") {
  return {"--model", "mlp", "--max-steps", "6", "--batch-size", "64", "--seed", seed, "--save-final", weights};
}

}  // namespace

TEST_CASE("--device cuda without a usable GPU exits 2 quoting why the runtime sees none", "[e2e][device]") {
  const auto r = train({"--device", "cuda", "--max-steps", "1"});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code == 2);
  // The runtime's own reason, whichever it is here: no driver, no device, or a build
  // without CUDA, followed by what CUDA_VISIBLE_DEVICES said.
  CHECK_THAT(r.err, Contains("--device cuda, but no GPU is usable: ") && Contains("(CUDA_VISIBLE_DEVICES=)"));
  CHECK_THAT(r.err, Contains("driver") || Contains("no CUDA-capable device") || Contains("built without CUDA") ||
                        Contains("no devices"));
  CHECK(r.err_lines().size() == 1);  // one line, nothing trained
  CHECK_THAT(r.out, !Contains("epoch 1"));
}

TEST_CASE("--device cpu trains exactly what the default trains without a GPU", "[e2e][device]") {
  TempDir dir;
  const std::string by_default = dir.file("default.safetensors");
  const std::string on_cpu = dir.file("cpu.safetensors");
  const auto a = train(short_run(by_default));
  require_success(a);
  const auto b = train(mtrain::testing::concat(short_run(on_cpu), {"--device", "cpu"}));
  require_success(b);
  CHECK_THAT(a.out, Contains("device: cpu, no GPU is usable (") && Contains("), so the CPU trains"));
  // In plain words, not CUDA's "driver version is insufficient" on a machine without a driver.
  CHECK_THAT(a.out, !Contains("cudaErrorInsufficientDriver"));
  CHECK_THAT(b.out, Contains("device: cpu, --device cpu"));
  CHECK_THAT(b.out, Contains("img/s on [cpu]"));
  const auto d = mtrain::testing::compare_weights(by_default, on_cpu);
  INFO(d.describe());
  CHECK(d.identical());
}

TEST_CASE("--deterministic --cudnn-benchmark --no-tf32 --cuda-graphs are accepted on the CPU and change nothing there",
          "[e2e][device]") {
  TempDir dir;
  const std::string plain = dir.file("plain.safetensors");
  const std::string flagged = dir.file("flagged.safetensors");
  require_success(train(short_run(plain)));
  const auto r = train(mtrain::testing::concat(short_run(flagged),
                                              {"--deterministic", "--cudnn-benchmark", "--no-tf32", "--cuda-graphs"}));
  require_success(r);
  CHECK_THAT(r.out, Contains("--cuda-graphs: not used: training on the CPU"));
  const auto d = mtrain::testing::compare_weights(plain, flagged);
  INFO(d.describe());
  CHECK(d.identical());
  // A different seed does change the weights: the comparison can fail.
  const std::string reseeded = dir.file("reseeded.safetensors");
  require_success(train(short_run(reseeded, "6")));
  CHECK_FALSE(mtrain::testing::compare_weights(plain, reseeded).identical());
}

TEST_CASE("--backend nccl on the CPU is a clear error before anything is loaded", "[e2e][device]") {
  const auto r = train({"--backend", "nccl", "--max-steps", "1"});
  INFO("stderr:\n" << r.err);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--backend nccl needs GPUs"));
  CHECK_THAT(r.out, !Contains("train set"));
}
