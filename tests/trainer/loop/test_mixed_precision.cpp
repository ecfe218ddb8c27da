// --amp and loss scaling: the LossScaler's rules in-process, then real mtrain-train runs
// on the shipped subset (Note [Mixed precision] in models/mixed_precision.cpp, Note
// [Dynamic loss scaling] in trainer/loop/loss_scaler.cpp). The children hide every GPU, so the
// runs mean the same on a machine with one.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "tensor/ops.h"
#include "tests/support/scoped_env.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/metrics_events.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "tests/trainer/weights_compare.h"
#include "trainer/loop/loss_scaler.h"
#include "trainer/checkpoint/safetensors.h"

using Catch::Matchers::Contains;
using mtrain::DType;
using mtrain::LossScaler;
using mtrain::LossScalerOptions;
using mtrain::Tensor;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;
using mtrain::testing::concat;
using mtrain::testing::read_events;

namespace {

Tensor vec(std::vector<float> v) { return Tensor::from_vector<float>(v, {static_cast<int64_t>(v.size())}); }

ProcessResult train(std::vector<std::string> args) {
  const mtrain::testing::ScopedEnv no_gpus("CUDA_VISIBLE_DEVICES", "");
  args.insert(args.end(), {"--threads", "1", "--data-dir", mtrain::testing::kMiniSet});
  return mtrain::testing::run_process(mtrain::testing::kTrainer, args);
}

void require_success(const ProcessResult& r) {
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
}

// Whether two weight files hold bit-identical parameters; the BatchNorm buffers are left
// out (a skipped step still ran its forward, which updated them, as in PyTorch).
bool same_parameters(const std::string& a_path, const std::string& b_path) {
  const auto a = mtrain::load_safetensors(a_path);
  const auto b = mtrain::load_safetensors(b_path);
  REQUIRE(a.tensors.size() == b.tensors.size());
  bool same = true;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [name, x] = a.tensors[i];
    REQUIRE(name == b.tensors[i].first);
    if (name.find("running_") != std::string::npos || name.find("num_batches_tracked") != std::string::npos) {
      continue;
    }
    const Tensor& y = b.tensors[i].second;
    REQUIRE(x.nbytes() == y.nbytes());
    if (std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) != 0) {
      UNSCOPED_INFO("parameter " << name << " differs");
      same = false;
    }
  }
  return same;
}

bool bf16_here() {
  if (mtrain::ops::compute_dtype_supported(DType::BFloat16, mtrain::Device::cpu())) return true;
  WARN("skipped: oneDNN has no bfloat16 convolutions on this CPU");
  return false;
}

}  // namespace

TEST_CASE("LossScaler: halves on overflow and skips, doubles after the growth interval", "[mixed]") {
  LossScalerOptions o;
  o.initial_scale = 1024.0;
  o.growth_interval = 3;
  LossScaler s(o);
  CHECK(s.scale() == 1024.0f);
  Tensor g = vec({1024.0f, -2048.0f});
  CHECK_FALSE(s.unscale_and_update({&g}));
  CHECK(g.to_vector<float>() == std::vector<float>{1.0f, -2.0f});  // unscaled
  Tensor bad = vec({1.0f, std::numeric_limits<float>::infinity()});
  CHECK(s.unscale_and_update({&g, &bad}));
  CHECK(s.scale() == 512.0f);
  CHECK(s.state().skipped_steps == 1);
  CHECK(s.state().good_steps == 0);  // the overflow restarted the count
  for (int i = 0; i < 2; ++i) CHECK_FALSE(s.unscale_and_update({&g}));
  CHECK(s.scale() == 512.0f);
  CHECK_FALSE(s.unscale_and_update({&g}));
  CHECK(s.scale() == 1024.0f);  // third finite step in a row
  CHECK(s.state().good_steps == 0);
}

TEST_CASE("LossScaler: never grows past float32, and gradients never finite are a divergence", "[mixed]") {
  LossScalerOptions o;
  o.initial_scale = 3e38;
  o.growth_interval = 1;
  LossScaler s(o);
  Tensor g = vec({0.0f});
  CHECK_FALSE(s.unscale_and_update({&g}));
  CHECK(s.scale() == 3e38f);  // 6e38 is not a float32
  Tensor nan = vec({std::nanf("")});
  for (int64_t i = 1; i < LossScaler::kMaxConsecutiveSkips; ++i) CHECK(s.unscale_and_update({&nan}));
  CHECK_THROWS_WITH(s.unscale_and_update({&nan}), Contains("training diverged") && Contains("64 steps in a row"));

  CHECK_THROWS_AS(LossScaler(LossScalerOptions{0.0}), mtrain::InvalidArgument);
  CHECK_THROWS_AS(LossScaler(LossScalerOptions{1e39}), mtrain::InvalidArgument);
  CHECK_THROWS_AS(LossScaler(LossScalerOptions{1e-39}), mtrain::InvalidArgument);  // 1/scale overflows
  LossScaler r(LossScalerOptions{});
  CHECK_THROWS_AS(r.restore({-1.0, 0, 0}), mtrain::InvalidArgument);
  r.restore({256.0, 5, 2});
  CHECK(r.scale() == 256.0f);
  CHECK(r.state().skipped_steps == 2);
}

TEST_CASE("dynamic loss scaling without overflow trains the unscaled model bit for bit", "[e2e][mixed]") {
  // Scaling by powers of two is exact, so the scaled gradients unscale to the same bits;
  // a missing or doubled unscale would move every weight. lenet has no BatchNorm; mlp
  // would do as well.
  TempDir dir;
  const std::vector<std::string> base = {"--model", "lenet", "--init", "default", "--batch-size", "32",
                                         "--max-steps", "6", "--no-eval"};
  const auto plain = dir.file("plain.safetensors");
  const auto scaled = dir.file("scaled.safetensors");
  const auto metrics = dir.file("metrics.jsonl");
  require_success(train(concat(base, {"--save-final", plain})));
  require_success(train(concat(base, {"--save-final", scaled, "--loss-scale", "dynamic", "--initial-loss-scale",
                                      "1024", "--loss-scale-growth-interval", "2", "--log-every", "1", "--metrics",
                                      metrics})));
  const auto d = mtrain::testing::compare_weights(plain, scaled);
  INFO(d.describe());
  CHECK(d.identical());
  const auto steps = read_events(metrics, "step");
  REQUIRE(steps.size() == 6);
  // Doubling after every second finite step: 1024 -> 2048 at step 2, 8192 at step 6.
  CHECK(steps[0]["loss_scale"] == 1024.0);
  CHECK(steps[1]["loss_scale"] == 2048.0);
  CHECK(steps[5]["loss_scale"] == 8192.0);
  CHECK(steps[5]["skipped_steps"] == 0);
}

TEST_CASE("an overflowing loss scale skips the step, leaves the parameters and halves the scale", "[e2e][mixed]") {
  // resnet18's BatchNorm backward amplifies the gradient enough that float32 overflows at
  // a scale near its maximum within the first steps (which one depends on the data).
  TempDir dir;
  const std::vector<std::string> base = {"--model", "resnet18", "--batch-size", "8", "--no-eval", "--loss-scale",
                                         "dynamic", "--initial-loss-scale", "3.4e38"};
  const auto metrics = dir.file("metrics.jsonl");
  const auto r = train(concat(base, {"--max-steps", "4", "--log-every", "1", "--metrics", metrics}));
  require_success(r);
  const auto steps = read_events(metrics, "step");
  REQUIRE(steps.size() == 4);
  int64_t skipped_at = 0;  // the first skipped step, 1-based
  for (size_t i = 0; i < steps.size() && skipped_at == 0; ++i) {
    if (steps[i]["skipped_steps"] == 1) skipped_at = static_cast<int64_t>(i) + 1;
  }
  INFO("stdout:\n" << r.out);
  REQUIRE(skipped_at >= 1);
  CHECK(steps[skipped_at - 1]["loss_scale"] == 1.7e38);
  CHECK_THAT(r.out, Contains("step skipped: gradients not finite at loss scale 3.4e+38, which is now 1.7e+38"));
  // The parameters after the skipped step are those from before it.
  const auto before = dir.file("before.safetensors");
  const auto after = dir.file("after.safetensors");
  require_success(train(concat(base, {"--max-steps", std::to_string(skipped_at - 1), "--save-final", before})));
  require_success(train(concat(base, {"--max-steps", std::to_string(skipped_at), "--save-final", after})));
  CHECK(same_parameters(before, after));
  // ... while a step that was not skipped does change them.
  const auto next = dir.file("next.safetensors");
  require_success(train(concat(base, {"--max-steps", std::to_string(skipped_at + 1), "--save-final", next})));
  CHECK_FALSE(same_parameters(after, next));
}

TEST_CASE("a resumed run continues the loss scale where the checkpoint left it", "[e2e][mixed]") {
  TempDir dir;
  const std::vector<std::string> base = {"--model", "mlp", "--batch-size", "32", "--no-eval", "--loss-scale",
                                         "dynamic", "--loss-scale-growth-interval", "2", "--log-every", "1"};
  const auto straight = dir.file("straight.jsonl");
  const auto resumed = dir.file("resumed.jsonl");
  require_success(train(concat(base, {"--max-steps", "7", "--metrics", straight})));
  const auto ckpt = dir.file("ckpt");
  require_success(train(concat(base, {"--max-steps", "3", "--checkpoint-dir", ckpt, "--metrics", resumed})));
  require_success(train(concat(base, {"--max-steps", "7", "--checkpoint-dir", ckpt, "--metrics", resumed})));
  const auto a = read_events(straight, "step");
  const auto b = read_events(resumed, "step");
  REQUIRE(a.size() == 7);
  REQUIRE(b.size() == 7);
  // Starting again from 65536 at step 4 would give 131072 at step 7 instead of 2^19.
  CHECK(a[6]["loss_scale"] == 524288.0);
  CHECK(b[6]["loss_scale"] == a[6]["loss_scale"]);
  CHECK(b[3]["loss_scale"] == a[3]["loss_scale"]);
}

TEST_CASE("bf16 mixed precision trains close to float32 but not identically, and says so", "[e2e][mixed]") {
  if (!bf16_here()) return;
  TempDir dir;
  const std::vector<std::string> base = {"--model", "lenet", "--init", "default", "--batch-size", "32",
                                         "--lr", "0.1", "--no-eval"};
  const auto start = dir.file("start.safetensors");
  const auto f32 = dir.file("f32.safetensors");
  const auto bf16 = dir.file("bf16.safetensors");
  const auto other_lr = dir.file("other_lr.safetensors");
  require_success(train(concat(base, {"--max-steps", "0", "--save-final", start})));
  require_success(train(concat(base, {"--max-steps", "10", "--save-final", f32})));
  const auto r = train(concat(base, {"--max-steps", "10", "--save-final", bf16, "--amp", "bf16"}));
  require_success(r);
  CHECK_THAT(r.out, Contains("--amp bf16: convolutions and linear layers multiply in bfloat16"));
  require_success(train({"--model", "lenet", "--init", "default", "--batch-size", "32", "--lr", "0.09", "--no-eval",
                         "--max-steps", "10", "--save-final", other_lr}));
  const auto amp = mtrain::testing::compare_training(bf16, f32, start);
  const auto lr = mtrain::testing::compare_training(other_lr, f32, start);
  INFO("bf16 vs float32: " << amp.describe() << "; lr 0.09 vs 0.1: " << lr.describe());
  CHECK_FALSE(mtrain::testing::compare_weights(bf16, f32).identical());
  // bfloat16 moves each operand by at most 2^-8 relative; over ten steps the updates
  // stay within a few percent of float32's, closer than a 10 % change of the rate.
  CHECK(amp.update < 0.05);
  CHECK(amp.update < lr.update);
}

TEST_CASE("mixed precision without the CPU's support, and bad loss-scale flags, are clear errors", "[e2e][mixed]") {
  if (!mtrain::ops::compute_dtype_supported(DType::Float16, mtrain::Device::cpu())) {
    const auto r = train({"--amp", "fp16", "--max-steps", "1"});
    INFO("stderr:\n" << r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Contains("--amp fp16: cpu has no float16 convolutions (" +
                               mtrain::ops::cpu_convolution_library() + " has none for this CPU)"));
    // The suggestion is the option that works on this CPU.
    CHECK_THAT(r.err, Contains(mtrain::ops::compute_dtype_supported(DType::BFloat16, mtrain::Device::cpu())
                                   ? "use --amp bf16 instead"
                                   : "run without --amp"));
    CHECK_THAT(r.out, !Contains("train set"));
  }
  if (!mtrain::ops::compute_dtype_supported(DType::BFloat16, mtrain::Device::cpu())) {  // e.g. AVX2 only
    const auto r = train({"--amp", "bf16", "--max-steps", "1"});
    INFO("stderr:\n" << r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Contains("--amp bf16: cpu has no bfloat16 convolutions (" +
                               mtrain::ops::cpu_convolution_library() +
                               " needs AVX512_BF16, or at least AVX-512, for them); run without --amp"));
    CHECK_THAT(r.out, !Contains("train set"));
  }
  for (const auto& [flags, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--amp", "fp8"}, "--amp: unknown value 'fp8' (valid: off, bf16, fp16)"},
           {{"--loss-scale", "static"}, "--loss-scale: unknown value 'static' (valid: auto, dynamic, none)"},
           {{"--initial-loss-scale", "0"}, "--initial-loss-scale: expected a number from 1.2e-38 to 3.4e38"},
           {{"--initial-loss-scale", "1e-39"}, "--initial-loss-scale: expected a number from 1.2e-38 to 3.4e38"},
           {{"--initial-loss-scale", "1e39"}, "--initial-loss-scale: expected a number from 1.2e-38 to 3.4e38"},
           {{"--loss-scale-growth-interval", "0"}, "--loss-scale-growth-interval"}}) {
    const auto r = train(concat(flags, {"--max-steps", "1"}));
    INFO("stderr:\n" << r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Contains(message));
  }
}
