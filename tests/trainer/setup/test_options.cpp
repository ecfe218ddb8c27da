// mtrain-train's command line, thread defaults and metrics lines.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdlib.h>

#include "tests/support/scoped_env.h"
#include "core/error.h"
#include "tests/trainer/temp_dir.h"
#include "trainer/setup/environment.h"
#include "trainer/loop/metrics.h"
#include "trainer/loop/progress.h"
#include "trainer/options.h"
#include "trainer/setup/agreement.h"

using Catch::Matchers::Contains;
using mtrain::InvalidArgument;
using mtrain::TrainChoices;

namespace {

using mtrain::testing::ScopedEnv;

const TrainChoices kChoices{{"lenet", "mlp", "resnet18", "simplecnn"},
                            {"fashion-mnist", "mnist", "synthetic", "imagefolder", "webdataset"}};

mtrain::ParsedTrainCommandLine parse(std::vector<std::string> args) {
  args.insert(args.begin(), "mtrain-train");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return mtrain::parse_train_command_line(static_cast<int>(argv.size()), argv.data(), kChoices);
}

}  // namespace

TEST_CASE("the defaults are valid and flags override them", "[options]") {
  const auto defaults = parse({});
  CHECK_FALSE(defaults.help);
  CHECK_NOTHROW(mtrain::validate_train_options(defaults.options, kChoices));
  CHECK_FALSE(defaults.options.max_steps.has_value());
  CHECK_FALSE(defaults.options.threads.has_value());

  const auto o = parse({"--model", "resnet18", "--dataset", "synthetic", "--data-dir", "/x", "--epochs", "3",
                        "--max-steps", "0", "--batch-size", "8", "--lr", "0.5", "--momentum", "0",
                        "--weight-decay", "5e-4", "--seed", "42", "--threads", "3", "--init", "normal",
                        "--no-shuffle", "--init-from", "a.safetensors", "--save-final", "b.safetensors",
                        "--metrics", "m.jsonl", "--no-eval", "--log-level", "debug", "--log-every", "7"})
                     .options;
  CHECK(o.model == "resnet18");
  CHECK(o.dataset == "synthetic");
  CHECK(o.data_dir == "/x");
  CHECK(o.epochs == 3);
  REQUIRE(o.max_steps.has_value());
  CHECK(*o.max_steps == 0);
  CHECK(o.batch_size == 8);
  CHECK(o.lr == 0.5);
  CHECK(o.momentum == 0.0);
  CHECK(o.weight_decay == 5e-4);
  CHECK(o.seed == 42);
  CHECK(o.threads == std::optional<int>(3));
  CHECK(o.init.text == "normal");
  CHECK(o.init.value == mtrain::models::InitScheme::kNormal);
  CHECK_FALSE(o.shuffle);
  CHECK(o.init_from == "a.safetensors");
  CHECK(o.save_final == "b.safetensors");
  CHECK(o.metrics == "m.jsonl");
  CHECK_FALSE(o.eval);
  CHECK(o.log_level.value == spdlog::level::debug);
  CHECK(o.log_every == 7);
  CHECK(parse({"--momentum", "0.9", "--nesterov"}).options.nesterov);
  // A switch given =false is off (it used to count as given, so on).
  CHECK_FALSE(parse({"--momentum", "0.9", "--nesterov=false"}).options.nesterov);
  CHECK_FALSE(parse({"--sync-bn=false"}).options.sync_bn);
  CHECK(parse({"--no-eval=false"}).options.eval);
  CHECK(parse({"--sync-bn=true"}).options.sync_bn);
  CHECK(defaults.options.shuffle_order.value == mtrain::data::Permutation::kMtrain);
  CHECK_FALSE(defaults.options.drop_last);
  const auto parity = parse({"--shuffle-order", "torch", "--drop-last", "--init", "xavier"}).options;
  CHECK(parity.shuffle_order.value == mtrain::data::Permutation::kTorch);
  CHECK(parity.drop_last);
  CHECK(parity.init.value == mtrain::models::InitScheme::kXavier);
  CHECK_NOTHROW(mtrain::validate_train_options(parity, kChoices));
  CHECK_THROWS_WITH(parse({"--shuffle-order", "numpy"}), Catch::Contains("--shuffle-order") && Catch::Contains("numpy"));

  CHECK(defaults.options.backend.value.automatic());
  CHECK(defaults.options.bucket_cap_mb == 25.0);
  CHECK(defaults.options.grad_accum == 1);
  CHECK_FALSE(defaults.options.sync_bn);
  CHECK_FALSE(defaults.options.global_batch_size.has_value());
  const auto d = parse({"--backend", "gloo", "--bucket-cap-mb", "0.5", "--grad-accum", "4", "--check-replicas", "10",
                        "--sync-bn", "--timeout", "60", "--lr-scaling", "linear", "--warmup-epochs", "2.5",
                        "--lr-schedule", "cosine"})
                     .options;
  CHECK(d.backend.value.named->name == "gloo");
  CHECK(d.bucket_cap_mb == 0.5);
  CHECK(d.grad_accum == 4);
  CHECK(d.check_replicas == 10);
  CHECK(d.sync_bn);
  CHECK(d.timeout_seconds == 60.0);
  CHECK(d.lr_scaling.value == mtrain::LrScaling::kLinear);
  CHECK(d.warmup_epochs == 2.5);
  CHECK(d.lr_schedule.value == mtrain::LrScheduleKind::Cosine);
  CHECK(parse({"--global-batch-size", "30"}).options.global_batch_size == std::optional<int64_t>(30));
  const auto c = parse({"--checkpoint-dir", "runs/c", "--checkpoint-every", "50"}).options;
  CHECK(c.checkpoint_dir == "runs/c");
  CHECK(c.checkpoint_every == 50);
  CHECK(defaults.options.checkpoint_dir.empty());
  CHECK(defaults.options.checkpoint_every == 0);
}

TEST_CASE("--device and the GPU numerics flags", "[options]") {
  const auto defaults = parse({}).options;
  CHECK(defaults.device.value == mtrain::DeviceChoice::kAuto);
  // PyTorch's defaults: heuristics, no determinism requirement, TF32 convolutions.
  CHECK_FALSE(defaults.cudnn_benchmark);
  CHECK_FALSE(defaults.deterministic);
  CHECK(defaults.allow_tf32);
  CHECK(parse({"--device", "auto"}).options.device.value == mtrain::DeviceChoice::kAuto);
  CHECK(parse({"--device", "cuda"}).options.device.value == mtrain::DeviceChoice::kCuda);
  CHECK(parse({"--device", "cpu"}).options.device.value == mtrain::DeviceChoice::kCpu);
  const auto g = parse({"--device", "cuda", "--cudnn-benchmark", "--deterministic", "--no-tf32"}).options;
  CHECK(g.cudnn_benchmark);
  CHECK(g.deterministic);
  CHECK_FALSE(g.allow_tf32);
  // Each flag on its own sets only itself.
  CHECK(parse({"--cudnn-benchmark"}).options.cudnn_benchmark);
  CHECK_FALSE(parse({"--cudnn-benchmark"}).options.deterministic);
  CHECK(parse({"--deterministic"}).options.allow_tf32);
  CHECK_FALSE(parse({"--no-tf32"}).options.cudnn_benchmark);
  // The flags are accepted with --device cpu (they change nothing there).
  CHECK_NOTHROW(parse({"--device", "cpu", "--deterministic", "--cudnn-benchmark", "--no-tf32"}));
  CHECK_THAT(parse({"--help"}).help_text, Contains("--device") && Contains("--no-tf32") &&
                                              Contains("--cudnn-benchmark") && Contains("--deterministic"));
}

TEST_CASE("streamed sets: each split's transform from the crop and resize flags", "[options]") {
  using mtrain::data::ImageTransform;
  const auto streamed = [](std::vector<std::string> args) { return mtrain::streamed_options(parse(args).options); };
  const auto rrc = streamed({"--dataset", "webdataset", "--data-dir", "s", "--random-resized-crop", "224"});
  CHECK(rrc.train.kind == ImageTransform::Kind::kRandomResizedCrop);
  CHECK(rrc.eval.kind == ImageTransform::Kind::kCenterCrop);
  CHECK((rrc.eval.height == 224 && rrc.eval.shorter_side == 256));
  CHECK((rrc.train.reduced_decode && rrc.eval.reduced_decode));
  const auto centre = streamed({"--dataset", "imagefolder", "--center-crop", "224", "--resize", "240", "--full-decode"});
  CHECK(centre.train.kind == ImageTransform::Kind::kCenterCrop);
  CHECK(centre.eval.shorter_side == 240);
  CHECK_FALSE(centre.train.reduced_decode);
  const auto squash = streamed({"--dataset", "webdataset", "--data-dir", "s", "--resize", "24x40", "--no-eval"});
  CHECK((squash.train.kind == ImageTransform::Kind::kResize && squash.train.width == 40));
  CHECK_FALSE(squash.evaluate);
  // An image folder without a crop stays in memory.
  CHECK_FALSE(streamed({"--dataset", "imagefolder", "--resize", "32"}).streamed());
}

TEST_CASE("--resize: off, HxW, or N for NxN", "[options]") {
  CHECK(mtrain::parse_resize("off").height == 0);
  CHECK(mtrain::parse_resize("32").height == 32);
  CHECK(mtrain::parse_resize("32").width == 32);
  CHECK(mtrain::parse_resize("24x40").height == 24);
  CHECK(mtrain::parse_resize("24x40").width == 40);
  const auto resized = parse({"--dataset", "imagefolder", "--resize", "24x40"}).options.resize;
  CHECK(resized.text == "24x40");
  CHECK((resized.value.height == 24 && resized.value.width == 40));
}

TEST_CASE("--help returns the help text instead of options", "[options]") {
  const auto r = parse({"--help"});
  CHECK(r.help);
  CHECK_THAT(r.help_text, Contains("--batch-size") && Contains("--save-final") && Contains("--no-shuffle"));
}

TEST_CASE("bad values are one clear InvalidArgument naming the flag", "[options]") {
  using Case = std::pair<std::vector<std::string>, std::string>;
  const std::vector<Case> cases = {
      {{"--batch-size", "-5"}, "--batch-size: expected an integer in [1, 1000000], found -5"},
      {{"--batch-size", "0"}, "--batch-size: expected an integer in [1, 1000000], found 0"},
      {{"--batch-size", "12x"}, "--batch-size: expected an integer, found '12x'"},
      {{"--epochs", "0"}, "--epochs: expected an integer in [1, 1000000], found 0"},
      {{"--max-steps", "-1"}, "--max-steps: expected an integer >= 0, found -1"},
      {{"--lr", "0"}, "--lr: expected a number > 0 and at most 3.40282e+38 (float32's largest), found 0"},
      {{"--lr", "-0.1"}, "--lr: expected a number > 0 and at most"},
      {{"--lr", "nan"}, "--lr: expected a finite number, found 'nan'"},
      {{"--lr", "inf"}, "--lr: expected a finite number, found 'inf'"},
      {{"--lr", "fast"}, "--lr: expected a finite number, found 'fast'"},
      {{"--lr", "1e39"}, "--lr: expected a number > 0 and at most 3.40282e+38 (float32's largest), found 1e+39"},
      {{"--weight-decay", "1e39"}, "--weight-decay: expected a number >= 0 and at most"},
      {{"--epochs", " 1"}, "--epochs: expected an integer, found ' 1'"},
      {{"--epochs", "+1"}, "--epochs: expected an integer, found '+1'"},
      {{"--epochs", "99999999999999999999"}, "--epochs: expected an integer in [1, 1000000], found '99999999999999999999'"},
      {{"--momentum", "1"}, "--momentum: expected a number in [0, 1), found 1"},
      {{"--momentum", "-0.5"}, "--momentum: expected a number in [0, 1)"},
      {{"--weight-decay", "-1"}, "--weight-decay: expected a number >= 0 and at most"},
      {{"--momentum", "0", "--nesterov"}, "--nesterov needs a momentum > 0"},
      {{"--threads", "0"}, "--threads: expected an integer in [1, 4096], found 0"},
      {{"--log-every", "0"}, "--log-every: expected an integer >= 1, found 0"},
      {{"--progress-every", "0"}, "--progress-every: expected a number of seconds > 0 and at most 1e6, found 0"},
      {{"--seed", "-3"}, "--seed: expected an integer >= 0"},
      {{"--model", "alexnet"}, "--model: unknown value 'alexnet' (valid: lenet, mlp, resnet18, simplecnn, FILE.onnx)"},
      {{"--dataset", "cifar"}, "--dataset: unknown value 'cifar' (valid: fashion-mnist, mnist, synthetic, imagefolder, webdataset)"},
      {{"--init", "kaiming"}, "--init: unknown value 'kaiming' (valid: default, normal, xavier)"},
      {{"--log-level", "loud"}, "--log-level: unknown value 'loud'"},
      {{"--save-final", ""}, "--save-final: expected a path, found an empty string"},
      {{"--init-from", "w.safetensors", "--save-final", "w.safetensors"},
       "--save-final w.safetensors is the same file as --init-from w.safetensors"},
      {{"--init-from", "w.safetensors", "--save-final", "./x/../w.safetensors"},
       "--save-final ./x/../w.safetensors is the same file as --init-from w.safetensors"},
      {{"--checkpoint-dir", "runs/a", "--save-final", "runs/a/checkpoint.safetensors"},
       "--checkpoint-dir's checkpoint runs/a/checkpoint.safetensors is the same file as --save-final"},
      {{"--metrics", "runs/a/checkpoint.safetensors", "--checkpoint-dir", "runs/a/"},
       "--checkpoint-dir's checkpoint runs/a/checkpoint.safetensors is the same file as --metrics"},
      {{"--save-final", "m.jsonl", "--metrics", "m.jsonl"}, "--metrics m.jsonl is the same file as --save-final"},
      {{"--bogus"}, "bogus"},
      {{"--batch-size"}, "batch-size"},
      {{"stray"}, "unexpected argument 'stray'"},
      {{"--backend", "tcp"}, "--backend: unknown value 'tcp' (valid: auto, gloo, mpi, nccl)"},
      {{"--bucket-cap-mb", "0"}, "--bucket-cap-mb: expected a number > 0 and at most 1e6, found 0"},
      {{"--bucket-cap-mb", "1e300"}, "--bucket-cap-mb: expected a number > 0 and at most 1e6, found 1e+300"},
      {{"--grad-accum", "0"}, "--grad-accum: expected an integer in [1, 1000000], found 0"},
      {{"--check-replicas", "-1"}, "--check-replicas: expected an integer >= 0, found -1"},
      {{"--global-batch-size", "0"}, "--global-batch-size: expected an integer in [1, 1000000], found 0"},
      {{"--global-batch-size", "30", "--grad-accum", "2"}, "--global-batch-size cannot be combined with --grad-accum"},
      {{"--global-batch-size", "30", "--lr-scaling", "linear"}, "--global-batch-size fixes the global batch"},
      {{"--batch-size", "8", "--global-batch-size", "30"}, "--batch-size 8 and --global-batch-size 30: give one"},
      {{"--nesterov=yes"}, "--nesterov: a switch takes no value, or =true / =false (also 1, 0), found 'yes'"},
      {{"--sync-bn="}, "--sync-bn: a switch takes no value, or =true / =false (also 1, 0), found ''"},
      {{"--no-eval=TRUE"}, "--no-eval: a switch takes no value, or =true / =false (also 1, 0), found 'TRUE'"},
      {{"--timeout", "0"}, "--timeout: expected a number of seconds from 0.001 to 1e7, found 0"},
      {{"--timeout", "1e16"}, "--timeout: expected a number of seconds from 0.001 to 1e7, found 1e+16"},
      {{"--timeout", "0.0001"}, "--timeout: expected a number of seconds from 0.001 to 1e7, found 0.0001"},
      {{"--lr-scaling", "sqrt"}, "--lr-scaling: unknown value 'sqrt' (valid: none, linear)"},
      {{"--warmup-epochs", "-1"}, "--warmup-epochs: expected a number >= 0, found -1"},
      {{"--lr-schedule", "poly"}, "--lr-schedule: unknown value 'poly' (valid: constant, step, cosine)"},
      {{"--checkpoint-every", "-1", "--checkpoint-dir", "c"}, "--checkpoint-every: expected an integer >= 0, found -1"},
      {{"--checkpoint-every", "10"}, "--checkpoint-every 10 needs --checkpoint-dir DIR"},
      {{"--checkpoint-dir", ""}, "--checkpoint-dir: expected a path, found an empty string"},
      {{"--normalize", "0.5"}, "--normalize: expected none, auto or MEANS:STDS (e.g. 0.49,0.48,0.45:0.25,0.24,0.26), found '0.5'"},
      {{"--normalize", "0.5,0.4:0.2"}, "--normalize: expected as many means as stds, found 2 and 1 in '0.5,0.4:0.2'"},
      {{"--normalize", "0.5:0"}, "--normalize: expected every std > 0, found 0 in '0.5:0'"},
      {{"--normalize", "0.5,:0.2,0.2"}, "--normalize's mean: expected a finite number, found ''"},
      {{"--random-crop", "-1"}, "--random-crop"},
      {{"--skip-bad-images"}, "--skip-bad-images applies to --dataset imagefolder or webdataset, not to fashion-mnist"},
      {{"--resize", "32"}, "--resize applies to --dataset imagefolder or webdataset, not to fashion-mnist"},
      {{"--dataset", "imagefolder", "--resize", "32x"}, "--resize: expected off, HEIGHTxWIDTH or SIZE (e.g. 32x32 or 32), found '32x'"},
      {{"--dataset", "imagefolder", "--resize", "0x8"}, "--resize's height: expected an integer in [1, 65536], found 0"},
      {{"--dataset", "imagefolder", "--resize", "8xbig"}, "--resize's width"},
      {{"--dataset", "webdataset", "--data-dir", "s"}, "its images come in any size; give the training images' transform"},
      {{"--dataset", "webdataset", "--data-dir", "s", "--random-resized-crop", "224", "--resize", "300x300"},
       "the training images would be 224x224 (RandomResizedCrop(224)) but the evaluation images 300x300"},
      {{"--dataset", "imagefolder", "--center-crop", "224", "--resize", "256x300"}, "give --resize as one number"},
      {{"--random-resized-crop", "224"}, "--random-resized-crop applies to --dataset webdataset or imagefolder, not to fashion-mnist"},
      {{"--dataset", "imagefolder", "--random-resized-crop", "8", "--val-data", "v"}, "--val-data applies to --dataset webdataset, not to imagefolder"},
      {{"--dataset", "synthetic", "--synthetic-shape", "3x224"}, "--synthetic-shape: expected CxHxW (e.g. 3x224x224), found '3x224'"},
      {{"--dataset", "synthetic", "--synthetic-shape", "2x32x32"}, "expected 1 or 3 channels, found 2"},
      {{"--synthetic-shape", "3x32x32"}, "--synthetic-shape applies to --dataset synthetic, not to fashion-mnist"},
      {{"--device", "gpu"}, "--device: unknown value 'gpu' (valid: auto, cuda, cpu)"},
      {{"--save-onnx", "a.onnx"}, "--save-onnx a.onnx writes back the graph of an ONNX --model, but the model is mlp"},
      {{"--model", "net.onnx", "--channels-last"}, "--channels-last: a model from an ONNX file (net.onnx) runs [N, C, H, W] only"},
      {{"--device", "cuda:1"}, "--device: unknown value 'cuda:1' (valid: auto, cuda, cpu)"},
      {{"--device", ""}, "--device: unknown value '' (valid: auto, cuda, cpu)"},
      {{"--backend", "ucc"}, "--backend: unknown value 'ucc' (valid: auto, gloo, mpi, nccl)"},
      {{"--log-level", "loud"}, "--log-level: unknown value 'loud' (valid: trace, debug, info, warn, error, critical, off)"},
  };
  for (const auto& [args, fragment] : cases) {
    INFO(fmt::format("args: {}", fmt::join(args, " ")));
    CHECK_THROWS_MATCHES(parse(args), InvalidArgument,
                         Catch::Matchers::Predicate<InvalidArgument>(
                             [&](const InvalidArgument& e) {
                               const std::string m = e.what();
                               return m.find(fragment) != std::string::npos && m.find('\n') == std::string::npos;
                             },
                             "one line containing: " + fragment));
  }
}

TEST_CASE("thread count: flag, then OMP_NUM_THREADS, then 1 per rank, then every core", "[options]") {
  ScopedEnv local("LOCAL_WORLD_SIZE", std::nullopt);
  ScopedEnv ompi_local("OMPI_COMM_WORLD_LOCAL_SIZE", std::nullopt);
  ScopedEnv omp("OMP_NUM_THREADS", std::nullopt);

  const auto single = mtrain::discover_environment();
  CHECK(single.world_size == 1);
  CHECK(single.local_world_size == 1);
  const auto all = mtrain::resolve_num_threads(std::nullopt, single);
  CHECK(all.threads == mtrain::usable_cpu_count());
  CHECK_THAT(all.reason, Contains("cores"));
  CHECK(mtrain::resolve_num_threads(5, single).threads == 5);

  {
    ScopedEnv shared("LOCAL_WORLD_SIZE", "4");
    const auto env = mtrain::discover_environment();
    CHECK(env.local_world_size == 4);
    const auto t = mtrain::resolve_num_threads(std::nullopt, env);
    CHECK(t.threads == 1);
    CHECK_THAT(t.reason, Contains("LOCAL_WORLD_SIZE=4"));
    CHECK(mtrain::resolve_num_threads(3, env).threads == 3);
    ScopedEnv omp3("OMP_NUM_THREADS", "3");
    CHECK(mtrain::resolve_num_threads(std::nullopt, env).threads == 3);
  }
  {
    ScopedEnv mpi_local("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
    CHECK(mtrain::discover_environment().local_world_size == 2);
  }
  for (const char* bad_value : {"lots", "0", "1 2"}) {
    // Not a count: a warning and the default, not the end of the run.
    ScopedEnv bad("OMP_NUM_THREADS", bad_value);
    const auto t = mtrain::resolve_num_threads(std::nullopt, single);
    CHECK(t.threads == mtrain::usable_cpu_count());
    CHECK_THAT(t.warning, Contains(std::string("OMP_NUM_THREADS='") + bad_value + "' is not a thread count"));
  }
  {
    ScopedEnv bad("LOCAL_WORLD_SIZE", "0");
    CHECK_THROWS_WITH(mtrain::discover_environment(), Contains("LOCAL_WORLD_SIZE"));
  }
}

TEST_CASE("progress: the bar's cells and the time left", "[progress]") {
  CHECK(mtrain::Progress::bar(0, 10, 10) == "[..........]");
  CHECK(mtrain::Progress::bar(3, 10, 10) == "[###.......]");
  CHECK(mtrain::Progress::bar(10, 10, 10) == "[##########]");
  CHECK(mtrain::Progress::bar(5, 0, 4) == "[....]");
  CHECK(mtrain::Progress::format_duration(0) == "0:00");
  CHECK(mtrain::Progress::format_duration(65.4) == "1:05");
  CHECK(mtrain::Progress::format_duration(3723) == "1:02:03");
  CHECK(mtrain::Progress::format_duration(-3) == "0:00");
  CHECK(parse({}).options.progress_every == 10.0);
  CHECK(parse({"--progress-every", "2.5"}).options.progress_every == 2.5);
  // Only rank 0 reports progress, and only when info lines are shown.
  CHECK(mtrain::Progress::mode_for(1, true) == mtrain::Progress::Mode::kOff);
  CHECK(mtrain::Progress::mode_for(0, false) == mtrain::Progress::Mode::kOff);
  CHECK(mtrain::Progress::mode_for(0, true) != mtrain::Progress::Mode::kOff);
}

TEST_CASE("metrics are one flushed JSON object per line, non-finite numbers as null", "[metrics]") {
  mtrain::testing::TempDir dir;
  const std::string path = dir.file("m.jsonl");
  mtrain::MetricsWriter writer(path);
  CHECK(writer.enabled());
  writer.write({{"event", "step"}, {"step", 1}, {"loss", mtrain::json_number(2.5)}});
  // Flushed per line: readable before the writer is closed.
  {
    std::ifstream in(path);
    std::string line;
    REQUIRE(std::getline(in, line));
    CHECK(nlohmann::json::parse(line)["loss"] == 2.5);
  }
  writer.write({{"event", "epoch"}, {"loss", mtrain::json_number(std::nan(""))},
                {"acc", mtrain::json_number(INFINITY)}});
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  REQUIRE(lines.size() == 2);
  CHECK(lines[1]["event"] == "epoch");
  CHECK(lines[1]["loss"].is_null());
  CHECK(lines[1]["acc"].is_null());

  mtrain::MetricsWriter disabled;
  CHECK_FALSE(disabled.enabled());
  CHECK_NOTHROW(disabled.write({{"event", "x"}}));
  CHECK_THROWS_WITH(mtrain::MetricsWriter(dir.file("no/dir/m.jsonl")), Contains("no/dir/m.jsonl"));
}

TEST_CASE("a metrics file that cannot be written turns the writer off, never the run", "[metrics]") {
  // /dev/full opens, and every write to it fails with ENOSPC: a full disk.
  mtrain::MetricsWriter writer("/dev/full");
  REQUIRE(writer.enabled());
  CHECK_NOTHROW(writer.write({{"event", "step"}, {"step", 1}}));
  CHECK_FALSE(writer.enabled());
  CHECK_NOTHROW(writer.write({{"event", "step"}, {"step", 2}}));
}

// Note [Which flags must agree]: a flag missing from both lists would be neither
// compared nor known to be harmless, and a rank given it alone could hang its peers.
TEST_CASE("every flag is compared across ranks or known to be harmless per rank", "[options]") {
  const mtrain::TrainOptions defaults;
  std::vector<std::string> compared;
  for (const auto& item : mtrain::training_configuration(defaults, 100, "fingerprint", mtrain::Device::cpu())) {
    compared.push_back(item.name);
  }
  const auto has = [](const std::vector<std::string>& list, const std::string& name) {
    return std::find(list.begin(), list.end(), name) != list.end();
  };
  const std::vector<std::string> flags = mtrain::train_flag_names();
  REQUIRE(flags.size() > 40);
  for (const std::string& flag : flags) {
    INFO(flag);
    // --device's item names the resolved device kind.
    const bool in_compared = has(compared, flag) || (flag == "--device" && has(compared, "the training device (--device)"));
    CHECK(in_compared != has(mtrain::per_rank_flags(), flag));
  }
  for (const std::string& flag : mtrain::per_rank_flags()) CHECK(has(flags, flag));
}

// Note [One table of flags]: a flag's range is said once, so options filled by hand are
// refused with the parser's own words.
TEST_CASE("options filled by hand are checked against the same ranges as the command line", "[options]") {
  const auto refused = [](const mtrain::TrainOptions& o) {
    try {
      mtrain::validate_train_options(o, kChoices);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const auto parsed = [](std::vector<std::string> args) {
    try {
      parse(std::move(args));
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const auto hand_filled = [](const auto& set) {
    mtrain::TrainOptions o;
    set(o);
    return o;
  };
  CHECK(refused(hand_filled([](auto& o) { o.batch_size = 0; })) == parsed({"--batch-size", "0"}));
  CHECK(refused(hand_filled([](auto& o) { o.lr = 0; })) == parsed({"--lr", "0"}));
  CHECK(refused(hand_filled([](auto& o) { o.threads = 5000; })) == parsed({"--threads", "5000"}));
  CHECK(refused(hand_filled([](auto& o) {
          o.trace_first_step = 9;
          o.trace_last_step = 3;
        })) == parsed({"--trace-steps", "9:3"}));
  const mtrain::TrainOptions defaults;
  CHECK(refused(defaults) == "accepted");
}

TEST_CASE("the ranks compare every flag's value as its row shows it", "[options]") {
  const auto value_of = [](const mtrain::TrainOptions& o, const std::string& name) {
    for (const auto& f : mtrain::flags_ranks_compare(o)) {
      if (f.name == name) return f.value;
    }
    return std::string("absent");
  };
  const auto o = parse({"--init-from", "w.safetensors", "--no-shuffle", "--amp", "fp16", "--lr", "0.25"}).options;
  CHECK(value_of(o, "--init-from") == "set");  // whether given, not where
  CHECK(value_of(o, "--no-shuffle") == "on");
  CHECK(value_of(o, "--amp") == "fp16");
  CHECK(value_of(o, "--loss-scale") == "dynamic");  // auto resolves with --amp fp16
  CHECK(value_of(o, "--lr") == "0.25");
  CHECK(value_of(o, "--metrics") == "absent");  // per rank
  CHECK(value_of(o, "--device") == "absent");   // compared as the device it resolves to
  const mtrain::TrainOptions defaults;
  CHECK(value_of(defaults, "--init-from") == "unset");
}

TEST_CASE("choices are parsed once, into the values the run reads, and keep the words given", "[options]") {
  const auto o = parse({"--amp", "bf16", "--grad-compression", "fp16", "--loss-scale", "dynamic", "--normalize",
                        "0.5:0.25", "--global-batch-size", "6", "--balance", "static:4,2"})
                     .options;
  CHECK(o.amp.value == mtrain::DType::BFloat16);
  CHECK(o.amp.text == "bf16");
  CHECK(o.grad_compression.value == mtrain::DType::Float16);
  CHECK(o.loss_scale.value == mtrain::LossScaling::kDynamic);
  CHECK(o.normalize.value.mean == std::vector<float>{0.5f});
  CHECK(o.normalize.value.std == std::vector<float>{0.25f});
  CHECK(o.balance.value.kind == mtrain::BalanceSpec::Kind::kStatic);
  CHECK(o.balance.value.shares == std::vector<int64_t>{4, 2});
  CHECK(o.balance.text == "static:4,2");
  const mtrain::TrainOptions defaults;
  CHECK(defaults.amp.value == mtrain::DType::Float32);
  CHECK(defaults.grad_compression.value == mtrain::DType::Float32);
  CHECK(defaults.balance.value.kind == mtrain::BalanceSpec::Kind::kEven);
  // The defaults' words are the ones --help shows and a parse of them gives.
  const auto given = parse({"--amp", defaults.amp.text, "--balance", defaults.balance.text, "--lr-schedule",
                            defaults.lr_schedule.text, "--shuffle-order", defaults.shuffle_order.text})
                         .options;
  CHECK(given.amp.value == defaults.amp.value);
  CHECK(given.balance.value.kind == defaults.balance.value.kind);
  CHECK(given.lr_schedule.value == defaults.lr_schedule.value);
  CHECK(given.shuffle_order.value == defaults.shuffle_order.value);
}
