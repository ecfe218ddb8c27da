// End to end: the real mtrain-train binary on the shipped Fashion-MNIST subset (and on
// a 32-image slice of it for resnet18), checked through its exit code, its stderr, its
// metrics file and the weights it writes.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "models/zoo.h"
#include "tests/data/cifar_fixtures.h"
#include "tests/store/store_test_util.h"
#include "tests/support/scoped_env.h"
#include "tests/trainer/idx_slice.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "tests/trainer/weights_compare.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/checkpoint/safetensors.h"

using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;
using nlohmann::json;

namespace {

const std::string kBinary = MTRAIN_BIN_DIR "/mtrain-train";
const std::string kMiniSet = MTRAIN_SOURCE_DIR "/data/fashion-mnist-mini";

ProcessResult train(std::vector<std::string> args) {
  // One intra-op thread unless a test says otherwise: CTest may run other tests beside
  // this one on a 2-core machine, and OpenMP threads that spin-wait for a descheduled
  // sibling make an oversubscribed run many times slower than a single thread.
  if (std::find(args.begin(), args.end(), "--threads") == args.end()) args.insert(args.end(), {"--threads", "1"});
  // Explicit --data-dir: a full data/fashion-mnist in the checkout must not make the
  // tests slower or change their numbers.
  if (std::find(args.begin(), args.end(), "--data-dir") == args.end() &&
      std::find(args.begin(), args.end(), "synthetic") == args.end()) {
    args.insert(args.end(), {"--data-dir", kMiniSet});
  }
  return mtrain::testing::run_process(kBinary, args);
}

void require_success(const ProcessResult& r) {
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
}

std::vector<json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  std::vector<json> events;
  for (std::string line; std::getline(in, line);) {
    INFO("metrics line: " << line);
    REQUIRE_NOTHROW(events.push_back(json::parse(line)));
    REQUIRE(events.back().is_object());
    REQUIRE(events.back().contains("event"));
  }
  return events;
}

std::vector<json> events_of(const std::vector<json>& events, const std::string& kind) {
  std::vector<json> out;
  for (const auto& e : events) {
    if (e["event"] == kind) out.push_back(e);
  }
  return out;
}

void require_same_tensors(const mtrain::SafetensorsFile& a, const mtrain::SafetensorsFile& b) {
  const auto d = mtrain::testing::compare_weights(a, b);
  INFO(d.describe());
  CHECK(d.identical());
}

}  // namespace

TEST_CASE("mlp learns the shipped Fashion-MNIST subset well above chance", "[e2e]") {
  // mlp rather than lenet: d2l's sigmoid LeNet sits on its initial plateau (loss 2.30,
  // chance accuracy) for far more than a few hundred steps on 6,000 images.
  TempDir dir;
  const std::string metrics = dir.file("metrics.jsonl");
  const auto r = train({"--model", "mlp", "--epochs", "2", "--batch-size", "64", "--lr", "0.05",
                        "--momentum", "0.9", "--log-every", "25", "--metrics", metrics});
  require_success(r);

  // The d2l-style line, once per epoch, on stdout.
  const std::regex epoch_line(
      R"(epoch [12], loss \d+\.\d{3}, train acc \d\.\d{3}, test acc \d\.\d{3}, \d+\.\d sec/epoch, \d+ img/s on \[cpu\])");
  CHECK(std::distance(std::sregex_iterator(r.out.begin(), r.out.end(), epoch_line), std::sregex_iterator()) == 2);
  CHECK_THAT(r.out, Contains("fashion-mnist-mini") && Contains("device: cpu") && Contains("model mlp"));

  const auto events = read_metrics(metrics);
  const auto steps = events_of(events, "step");
  const auto epochs = events_of(events, "epoch");
  REQUIRE(epochs.size() == 2);
  const int64_t steps_per_epoch = (6000 + 63) / 64;
  CHECK(epochs.back()["step"] == 2 * steps_per_epoch);
  CHECK(steps.size() == static_cast<size_t>(2 * steps_per_epoch / 25));
  for (const auto& s : steps) {
    CHECK(s["step"].get<int64_t>() % 25 == 0);
    CHECK(s["loss"].is_number());
    CHECK(s["lr"].get<double>() == Approx(0.05));
    CHECK(s["img_per_s"].get<double>() > 0);
  }
  for (const auto& e : epochs) {
    for (const char* key : {"train_loss", "train_acc", "test_acc", "test_loss", "sec", "img_per_s"}) {
      INFO(key);
      CHECK(e[key].is_number());
    }
    CHECK(e["devices"] == json::array({"cpu"}));
    CHECK(e["steps"] == steps_per_epoch);  // whole epochs: every image, not partial
    CHECK(e["images"] == 6000);
    CHECK(e["partial"] == false);
    CHECK(e["host_tensor_peak_mib"].get<double>() > 0.0);
    CHECK(e["host_tensor_peak_mib"].get<double>() <= e["host_tensor_held_mib"].get<double>());
    CHECK_FALSE(e.contains("cuda_reserved_mib"));
  }
  // Note [Host caching allocator]: the second epoch (training and evaluation) takes every
  // block from the cache the first one filled.
  CHECK(epochs[1]["host_tensor_held_mib"] == epochs[0]["host_tensor_held_mib"]);
  const double final_acc = epochs.back()["test_acc"].get<double>();
  INFO("final test accuracy " << final_acc);
  CHECK(final_acc > 0.6);
  CHECK(epochs.back()["train_loss"].get<double>() < 0.6 * steps.front()["loss"].get<double>());
}

TEST_CASE("resnet18 trains a few steps on a tiny batch and its loss falls", "[e2e]") {
  TempDir dir;
  const std::string data_dir = dir.file("slice");
  std::filesystem::create_directory(data_dir);
  mtrain::testing::write_idx_slice(kMiniSet, data_dir, 16);
  const std::string metrics = dir.file("metrics.jsonl");
  const std::string weights = dir.file("resnet18.safetensors");
  // Two steps of 8 images per epoch: by the fourth pass over the same 16 images the
  // network has started to memorise them (measured: mean loss 2.3, 1.4, 0.8, 0.2). A
  // larger lr (0.05) makes batch-8 BatchNorm training bounce instead.
  const auto r = train({"--model", "resnet18", "--data-dir", data_dir, "--epochs", "4", "--batch-size", "8",
                        "--lr", "0.01", "--momentum", "0.9", "--log-every", "1", "--metrics", metrics,
                        "--save-final", weights});
  require_success(r);
  const auto events = read_metrics(metrics);
  const auto epochs = events_of(events, "epoch");
  REQUIRE(epochs.size() == 4);
  CHECK(events_of(events, "step").size() == 8);
  const double first = epochs.front()["train_loss"].get<double>();
  const double last = epochs.back()["train_loss"].get<double>();
  INFO("train loss per epoch: " << first << " ... " << last);
  CHECK(last < 0.6 * first);
  CHECK(epochs.back()["test_acc"].is_number());  // eval mode ran (running statistics)

  // The file carries every parameter and buffer under PyTorch's names, including the
  // BatchNorm running statistics that training moved away from their initial values.
  const auto file = mtrain::load_safetensors(weights);
  const auto model = mtrain::models::build_model("resnet18", 1, 10);
  CHECK(file.tensors.size() == model->parameters().size() + model->buffers().size());
  const auto running_var = file.find("0.1.running_var");
  REQUIRE(running_var.defined());
  const auto v = running_var.to_vector<float>();
  CHECK(std::any_of(v.begin(), v.end(), [](float x) { return std::abs(x - 1.0f) > 1e-3f; }));
  CHECK(file.metadata.at("mtrain.steps") == "8");
  CHECK(file.metadata.at("mtrain.model") == "resnet18");
}

TEST_CASE("--dataset cifar10: colour 32x32 images train simplecnn and resnet18; lenet says it cannot", "[e2e]") {
  TempDir dir;
  const std::string data_dir = dir.file("cifar");
  mtrain::testing::write_cifar_dir(data_dir, "cifar10", 16);  // 80 training images, 16 test
  for (const std::string model : {"simplecnn", "resnet18"}) {
    INFO(model);
    const std::string metrics = dir.file(model + ".jsonl");
    const auto r = train({"--dataset", "cifar10", "--data-dir", data_dir, "--model", model, "--batch-size", "16",
                          "--max-steps", "3", "--lr", "0.01", "--log-every", "1", "--metrics", metrics, "--log-level", "info"});
    require_success(r);
    CHECK_THAT(r.out, Contains("train set: cifar10/train: 80 images 3x32x32, 10 classes"));
    CHECK(events_of(read_metrics(metrics), "step").size() == 3);
  }
  const auto augmented = train({"--dataset", "cifar10", "--data-dir", data_dir, "--model", "simplecnn", "--batch-size",
                                 "16", "--max-steps", "2", "--random-crop", "4", "--random-flip", "--normalize", "auto",
                                 "--log-level", "info"});
  require_success(augmented);
  CHECK_THAT(augmented.out, Contains("--normalize auto: cifar10/train's per-channel mean"));
  CHECK_THAT(augmented.out, Contains("random crop (padding 4), random horizontal flip, (pixels/255 - "));
  const auto r = train({"--dataset", "cifar10", "--data-dir", data_dir, "--model", "lenet", "--max-steps", "1"});
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.err, Contains("model 'lenet' takes 28x28 images, the data has 32x32; pick resnet18 or simplecnn"));
}

// Note [Speed switches] in core/speedups.h: how a step is computed, not what is trained.
TEST_CASE("MTRAIN_SPEEDUPS: fused-bn and fresh-grads train the same bits, skip-conv-bias the same model",
          "[e2e]") {
  TempDir dir;
  const std::string data_dir = dir.file("slice");
  std::filesystem::create_directory(data_dir);
  mtrain::testing::write_idx_slice(kMiniSet, data_dir, 16);
  const auto run = [&](const std::string& tag, const std::string& speedups, const std::string& steps,
                       const std::string& lr) {
    const mtrain::testing::ScopedEnv env("MTRAIN_SPEEDUPS", speedups);
    const std::string weights = dir.file(tag + ".safetensors");
    const auto r = train({"--model", "resnet18", "--data-dir", data_dir, "--batch-size", "8", "--max-steps", steps,
                          "--lr", lr, "--momentum", "0.9", "--seed", "4", "--save-final", weights});
    require_success(r);
    if (!speedups.empty()) CHECK_THAT(r.out + r.err, Contains("speedups (MTRAIN_SPEEDUPS): "));
    return weights;
  };
  const auto exact = mtrain::testing::compare_weights(run("exact", "fused-bn,fresh-grads", "3", "0.01"),
                                                      run("plain", "", "3", "0.01"));
  INFO(exact.describe());
  CHECK(exact.identical());
  // skip-conv-bias adds each skipped bias to a mean instead of to every element: float
  // rounding, which resnet18's ReLUs amplify (Note [Equivalence tolerance] in
  // test_distributed_train.cpp; one ulp of noise on the input moved the first step's
  // gradients by 2e-3 of their size). Hence a rate at which a step barely changes the next
  // one's gradient, and a bound on how far the updates disagree, not bit equality.
  const std::string start = run("start", "", "0", "1e-5");
  const std::string all = run("all", "all", "2", "1e-5");
  const std::string plain = run("plain-slow", "", "2", "1e-5");
  const auto close = mtrain::testing::compare_training(all, plain, start);
  INFO(close.describe());
  CHECK(close.update < 2e-2);
  CHECK(close.statistics < 1e-4);
  CHECK_FALSE(mtrain::testing::compare_weights(all, plain).identical());

  {
    // 16-bit activations belong to --amp, which this CPU (no bfloat16 convolutions) refuses.
    const mtrain::testing::ScopedEnv env("MTRAIN_SPEEDUPS", "amp-activations");
    const auto r = train({"--model", "mlp", "--max-steps", "1"});
    require_success(r);
    CHECK_THAT(r.out + r.err, Contains("speedup amp-activations: not used without --amp"));
  }
  const mtrain::testing::ScopedEnv bad("MTRAIN_SPEEDUPS", "fused-bn,warp-drive");
  const auto r = train({"--model", "mlp", "--max-steps", "1"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("MTRAIN_SPEEDUPS") && Contains("'warp-drive'") && Contains("fused-bn"));
}

// Note [Channels-last models] in models/rewrites.h: the same model, another layout.
TEST_CASE("--channels-last trains resnet18 to the same model; lenet's pooling is refused", "[e2e]") {
  TempDir dir;
  const std::string data_dir = dir.file("slice");
  std::filesystem::create_directory(data_dir);
  mtrain::testing::write_idx_slice(kMiniSet, data_dir, 16);
  const auto run = [&](const std::string& tag, std::vector<std::string> extra) {
    const std::string weights = dir.file(tag + ".safetensors");
    std::vector<std::string> args = {"--model", "resnet18", "--data-dir", data_dir, "--batch-size", "8",
                                     "--lr", "1e-5", "--momentum", "0.9", "--seed", "4", "--save-final", weights};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = train(args);
    require_success(r);
    return std::pair{weights, r.out + r.err};
  };
  const auto [start, unused] = run("start", {"--max-steps", "0"});
  const auto [plain, plain_log] = run("plain", {"--max-steps", "2"});
  const auto [last, last_log] = run("last", {"--max-steps", "2", "--channels-last"});
  CHECK_THAT(last_log, Contains("--channels-last: 39 layers of model resnet18"));
  // Batch norm sums in another order: rounding, amplified by the ReLUs (as skip-conv-bias).
  const auto close = mtrain::testing::compare_training(last, plain, start);
  INFO(close.describe());
  CHECK(close.update < 2e-2);
  CHECK(close.statistics < 1e-4);

  const auto r = train({"--model", "lenet", "--max-steps", "1", "--channels-last"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("AvgPool2d") && Contains("channels last"));
}

namespace {

// A tmpfs of `size` mounted at `dir` for one test (root only; mounted() says whether it is).
class SmallDisk {
 public:
  SmallDisk(const std::string& dir, const std::string& size) : dir_(dir) {
    std::filesystem::create_directories(dir);
    mounted_ = mtrain::testing::run_process("/bin/mount", {"-t", "tmpfs", "-o", "size=" + size, "tmpfs", dir})
                   .exit_code == 0;
  }
  ~SmallDisk() {
    if (mounted_) mtrain::testing::run_process("/bin/umount", {dir_});
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;
  bool mounted() const { return mounted_; }

 private:
  std::string dir_;
  bool mounted_ = false;
};

}  // namespace

// README's "resumable run": a --checkpoint-dir relative to the working directory, not yet
// made, whose filesystem the room check asks through the working directory.
TEST_CASE("a relative --checkpoint-dir that does not exist yet is made and resumed from", "[e2e]") {
  const std::string relative = fmt::format("mtrain-test-relative-ckpt-{}", ::getpid());
  struct Remove {
    std::string path;
    ~Remove() { std::filesystem::remove_all(path); }
  } cleanup{relative};
  require_success(train({"--model", "mlp", "--max-steps", "2", "--no-eval", "--checkpoint-dir", relative}));
  CHECK(std::filesystem::exists(relative + "/checkpoint.safetensors"));
  const auto resumed = train({"--model", "mlp", "--max-steps", "3", "--no-eval", "--checkpoint-dir", relative});
  require_success(resumed);
  CHECK_THAT(resumed.out, Contains("resuming from"));
}

// Note [Room for the outputs] in trainer/setup/start_up.cpp.
TEST_CASE("outputs on a disk without room: refused before the first step, or metrics only warn", "[e2e]") {
  TempDir dir;
  SmallDisk disk(dir.file("small"), "16k");
  if (!disk.mounted()) {
    WARN("skipped: cannot mount a tmpfs here (needs root)");
    return;
  }
  const std::string small = dir.file("small");
  // resnet18's weights are 45 MiB: no room for them in 16 KiB, nor for a checkpoint.
  const auto final_weights = train({"--model", "resnet18", "--max-steps", "1", "--save-final", small + "/w.safetensors"});
  CHECK(final_weights.exit_code == 2);
  CHECK_THAT(final_weights.err, Contains("--save-final " + small + "/w.safetensors") && Contains("MiB free") &&
                                    Contains("the final weights take"));
  const auto checkpoints = train({"--model", "resnet18", "--max-steps", "1", "--checkpoint-dir", small + "/ckpt"});
  CHECK(checkpoints.exit_code == 2);
  CHECK_THAT(checkpoints.err, Contains("--checkpoint-dir") && Contains("a checkpoint's weights and momentum take"));

  // Metrics fill the 16 KiB within the first 100 steps (a line a step): a warning, and the
  // run ends with its weights.
  const std::string weights = dir.file("mlp.safetensors");
  const auto r = train({"--model", "mlp", "--max-steps", "200", "--log-every", "1", "--metrics",
                        small + "/m.jsonl", "--save-final", weights});
  require_success(r);
  CHECK_THAT(r.out + r.err, Contains("--metrics " + small + "/m.jsonl: cannot write") &&
                                Contains("training goes on without metrics"));
  CHECK(mtrain::load_safetensors(weights).metadata.at("mtrain.steps") == "200");
}

TEST_CASE("--save-final then --init-from gives back the same weights and evaluation", "[e2e]") {
  TempDir dir;
  const std::string trained = dir.file("trained.safetensors");
  const std::string reloaded = dir.file("reloaded.safetensors");
  const std::string m1 = dir.file("m1.jsonl");
  const std::string m2 = dir.file("m2.jsonl");
  require_success(train({"--model", "mlp", "--max-steps", "30", "--batch-size", "64", "--seed", "3",
                         "--save-final", trained, "--metrics", m1}));
  require_success(train({"--model", "mlp", "--init-from", trained, "--max-steps", "0", "--batch-size", "64",
                         "--save-final", reloaded, "--metrics", m2}));

  require_same_tensors(mtrain::load_safetensors(trained), mtrain::load_safetensors(reloaded));
  const auto after_training = events_of(read_metrics(m1), "epoch");
  const auto after_reload = events_of(read_metrics(m2), "eval");
  REQUIRE(after_training.size() == 1);  // 30 steps: part of the first epoch
  CHECK(after_training.back()["step"] == 30);
  REQUIRE(after_reload.size() == 1);
  CHECK(after_reload[0]["test_acc"] == after_training.back()["test_acc"]);
  CHECK(after_reload[0]["test_loss"].get<double>() ==
        Approx(after_training.back()["test_loss"].get<double>()).epsilon(1e-6));
}

TEST_CASE("--max-steps 0 --save-final writes exactly the initial weights", "[e2e]") {
  TempDir dir;
  const std::string path = dir.file("init.safetensors");
  require_success(train({"--model", "lenet", "--max-steps", "0", "--seed", "7", "--init", "normal",
                         "--no-eval", "--save-final", path}));
  const auto file = mtrain::load_safetensors(path);
  CHECK(file.metadata.at("mtrain.steps") == "0");

  mtrain::models::InitOptions init;
  init.scheme = mtrain::models::InitScheme::kNormal;
  init.seed = 7;
  const auto model = mtrain::models::build_model("lenet", 1, 10, init);
  mtrain::SafetensorsFile expected;
  expected.tensors = mtrain::model_state(*model);
  require_same_tensors(file, expected);

  // A different seed gives different weights, so the comparison above is not vacuous.
  const auto other = mtrain::models::build_model("lenet", 1, 10, {init.scheme, 8});
  const auto w7 = file.find("0.weight").to_vector<float>();
  CHECK(w7 != other->parameters().front().param->value.to_vector<float>());
}

TEST_CASE("bad input is one line on stderr and a non-zero exit", "[e2e]") {
  TempDir dir;
  const std::string corrupt = dir.file("corrupt.safetensors");
  std::ofstream(corrupt) << "definitely not safetensors";
  const std::string mlp_weights = dir.file("mlp.safetensors");
  require_success(train({"--model", "mlp", "--max-steps", "0", "--no-eval", "--save-final", mlp_weights}));
  // Training images of 28x28, test images of 32x32.
  const std::string mixed = dir.file("mixed");
  std::filesystem::create_directory(mixed);
  mtrain::testing::write_idx_slice(kMiniSet, mixed, 16);
  {
    std::ofstream out(mixed + "/t10k-images-idx3-ubyte", std::ios::binary | std::ios::trunc);
    const unsigned char header[16] = {0, 0, 8, 3, 0, 0, 0, 16, 0, 0, 0, 32, 0, 0, 0, 32};
    out.write(reinterpret_cast<const char*>(header), sizeof header);
    out.write(std::string(16 * 32 * 32, '\0').data(), 16 * 32 * 32);
  }

  // A FIFO: opening it would block, and a save renamed over it (or over /dev/null) would
  // replace the node with a regular file.
  const std::string fifo = dir.file("fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string fifo_checkpoints = dir.file("fifo-ckpt");
  std::filesystem::create_directory(fifo_checkpoints);
  REQUIRE(::mkfifo((fifo_checkpoints + "/checkpoint.safetensors").c_str(), 0600) == 0);

  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {{"--batch-size", "-4"}, 2, "--batch-size: expected an integer in [1, 1000000], found -4"},
      {{"--model", "vgg"}, 2, "--model: unknown value 'vgg' (valid: "},
      {{"--dataset", "imagenet"}, 2, "--dataset: unknown value 'imagenet'"},
      {{"--lr", "0"}, 2, "--lr: expected a number > 0 and at most"},
      {{"--epochs", "zero"}, 2, "--epochs: expected an integer, found 'zero'"},
      {{"--frobnicate"}, 2, "frobnicate"},
      {{"--data-dir", dir.file("no-such-dir")}, 1, "no-such-dir"},
      {{"--model", "mlp", "--init-from", corrupt, "--max-steps", "0"}, 1, "corrupt.safetensors"},
      {{"--model", "mlp", "--init-from", dir.file("absent.safetensors")}, 1, "absent.safetensors"},
      {{"--model", "lenet", "--init-from", mlp_weights}, 1, "the file holds --model mlp weights"},
      {{"--save-final", dir.file("missing/w.safetensors")}, 2, "does not exist"},
      {{"--save-final", dir.path().string()}, 2, "expected a regular file or a new name, found a directory"},
      {{"--data-dir", mixed, "--max-steps", "1"}, 1, "the training images are 1x28x28 but the test images 1x32x32"},
      {{"--save-final", fifo}, 2, "expected a regular file or a new name, found a FIFO"},
      {{"--metrics", fifo}, 2, "expected a regular file or a new name, found a FIFO"},
      {{"--model", "mlp", "--init-from", fifo}, 1, "expected a regular file, found a FIFO"},
      {{"--model", "mlp", "--checkpoint-dir", fifo_checkpoints}, 1, "expected a regular file, found a FIFO"},
  };
  for (const auto& c : cases) {
    INFO("args: " << fmt::format("{}", fmt::join(c.args, " ")));
    const auto r = train(c.args);
    INFO("stderr: " << r.err);
    CHECK(r.exit_code == c.exit_code);
    const auto lines = r.err_lines();
    REQUIRE(lines.size() == 1);
    CHECK_THAT(lines[0], StartsWith("mtrain-train: error: ") && Contains(c.fragment));
  }

  // The model error lists every valid name.
  const auto r = train({"--model", "vgg"});
  for (const auto& name : mtrain::models::model_names()) CHECK_THAT(r.err, Contains(name));
}

TEST_CASE("PyTorch parity options: torch.randperm's order, --drop-last, --init xavier", "[e2e]") {
  const auto r = train({"--model", "lenet", "--init", "xavier", "--shuffle-order", "torch", "--drop-last",
                        "--global-batch-size", "64", "--max-steps", "2", "--no-eval"});
  require_success(r);
  // 6,000 images in global batches of 64: the last 48 are dropped, in PyTorch's order.
  CHECK_THAT(r.out, Contains("93 steps shuffled (torch.randperm's order, seed 0 + epoch), last partial global "
                             "batch dropped"));
}

TEST_CASE("the log says why training ended: the epochs or --max-steps, whichever came first", "[e2e]") {
  const auto by_epochs = train({"--model", "mlp", "--epochs", "1", "--max-steps", "400", "--no-eval"});
  require_success(by_epochs);
  CHECK_THAT(by_epochs.out, Contains("training ended after --epochs 1 at step 24, before --max-steps 400 (raise "
                                     "--epochs to train longer)"));
  const auto by_steps = train({"--model", "mlp", "--max-steps", "3", "--no-eval"});
  require_success(by_steps);
  CHECK_THAT(by_steps.out, Contains("training ended at step 3: --max-steps 3 reached in epoch 1 of --epochs 10"));
}

TEST_CASE("progress never goes quiet: lines in a log, a bar redrawn in place on a terminal", "[e2e]") {
  // In a pipe: a progress line whenever --progress-every passed without one.
  const auto piped = train({"--model", "mlp", "--max-steps", "6", "--log-every", "1000", "--progress-every", "0.000001",
                            "--no-eval"});
  require_success(piped);
  const std::regex line(R"(epoch 1 step (\d+)/24 \(total \d+\): loss \d+\.\d{4}, \d+ img/s, \d+:\d\d left in the epoch)");
  CHECK(std::distance(std::sregex_iterator(piped.out.begin(), piped.out.end(), line), std::sregex_iterator()) == 6);
  CHECK_THAT(piped.out, !Contains("\r"));
  // The default interval keeps a short run's log as it was.
  const auto quiet = train({"--model", "mlp", "--max-steps", "6", "--log-every", "1000", "--no-eval"});
  require_success(quiet);
  CHECK(!std::regex_search(quiet.out, line));

  // On a terminal (script(1) gives the run a pseudo-terminal): one line redrawn in place.
  const std::string command = std::string(kBinary) + " --model mlp --max-steps 3 --log-every 1000";
  const auto tty = mtrain::testing::run_process("/usr/bin/env", {"TERM=xterm", "script", "-qec", command, "/dev/null"});
  INFO(tty.out << tty.err);
  require_success(tty);
  CHECK_THAT(tty.out, Contains("\r\x1b[Kepoch 1 [") && Contains("] 1/24 loss ") && Contains(" img/s ETA "));
  CHECK_THAT(tty.out, Contains("\r\x1b[Kepoch 1 evaluating [####################] 4/4 batches"));
  // Log lines erase the bar first, and the epoch line ends with the bar gone.
  CHECK_THAT(tty.out, Contains("\r\x1b[K[") && Contains("epoch 1, loss "));
}

TEST_CASE("--help prints the flags and exits 0", "[e2e]") {
  const auto r = mtrain::testing::run_process(kBinary, {"--help"});
  CHECK(r.exit_code == 0);
  CHECK(r.err.empty());
  for (const char* flag : {"--model", "--dataset", "--data-dir", "--epochs", "--max-steps", "--batch-size", "--lr",
                           "--momentum", "--weight-decay", "--nesterov", "--seed", "--threads", "--init",
                           "--no-shuffle", "--init-from", "--save-final", "--metrics", "--no-eval",
                           "--log-level", "--log-every"}) {
    CHECK_THAT(r.out, Contains(flag));
  }
}

TEST_CASE("more threads than the CPUs the process may use is warned about", "[e2e]") {
  // Under taskset (or mtrain-launch --cpu_bind cores) the threads would take turns.
  const auto r = mtrain::testing::run_process(
      "/usr/bin/taskset", {"-c", "0", kBinary, "--model", "mlp", "--max-steps", "1", "--threads", "2", "--no-eval",
                           "--data-dir", kMiniSet});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out + r.err, Contains("2 intra-op threads but this process may run on 1 CPU only"));
  const auto fits = train({"--model", "mlp", "--max-steps", "1", "--no-eval"});
  CHECK_THAT(fits.out + fits.err, !Contains("may run on"));
}

namespace {


// Sets several variables for the life of the object.
struct ScopedVars {
  std::vector<std::unique_ptr<mtrain::testing::ScopedEnv>> vars;
  explicit ScopedVars(const std::vector<std::pair<const char*, std::string>>& values) {
    for (const auto& [name, value] : values) vars.push_back(std::make_unique<mtrain::testing::ScopedEnv>(name, value));
  }
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TEST_CASE("a worker whose store never appears obeys --timeout and says what it waits for", "[e2e]") {
  // Rank 1 of 2 with torch-style variables: rank 0, which would host the store, never starts.
  const ScopedVars env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"},
                        {"MASTER_PORT", std::to_string(mtrain::testing::unused_loopback_port())}, {"MTRAIN_STORE_TOKEN", "t"}});
  const auto start = std::chrono::steady_clock::now();
  const auto r = train({"--model", "mlp", "--max-steps", "1", "--timeout", "5"});
  const double seconds = seconds_since(start);
  INFO("stderr:\n" << r.err);
  CHECK(r.exit_code != 0);
  CHECK(seconds < 8);  // --timeout 5 plus start-up; it was a fixed 300 s
  CHECK_THAT(r.out + r.err, Catch::Contains("still waiting for the store at 127.0.0.1:"));
  CHECK_THAT(r.err, Catch::Contains("could not reach the store"));
}

TEST_CASE("a store host name that does not resolve fails at once", "[e2e]") {
  const ScopedVars env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"},
                        {"MASTER_ADDR", "no-such-host.invalid"}, {"MASTER_PORT", "29511"}, {"MTRAIN_STORE_TOKEN", "t"}});
  const auto start = std::chrono::steady_clock::now();
  const auto r = train({"--model", "mlp", "--max-steps", "1", "--timeout", "60"});
  INFO("stderr:\n" << r.err);
  CHECK(r.exit_code == 2);
  CHECK(seconds_since(start) < 10);
  CHECK_THAT(r.err, Catch::Contains("cannot resolve the store host 'no-such-host.invalid'"));
}

TEST_CASE("a bad backend variable fails a one-rank run too; a bad OMP_NUM_THREADS is a warning", "[e2e]") {
  {
    const mtrain::testing::ScopedEnv env("MTRAIN_GLOO_LOOP_SCHED", std::string("bogus"));
    const auto r = train({"--model", "mlp", "--max-steps", "1"});
    INFO("stderr:\n" << r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("MTRAIN_GLOO_LOOP_SCHED"));
  }
  const mtrain::testing::ScopedEnv env("OMP_NUM_THREADS", std::string("1 2"));
  // No --threads, so the variable is consulted; LOCAL_WORLD_SIZE makes the default one thread.
  const mtrain::testing::ScopedEnv local("LOCAL_WORLD_SIZE", std::string("2"));
  const auto r = mtrain::testing::run_process(kBinary, {"--model", "mlp", "--max-steps", "1", "--data-dir", kMiniSet});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out + r.err, Catch::Contains("OMP_NUM_THREADS='1 2' is not a thread count"));
}
