// Training checkpoints in-process: what is saved comes back (model, buffers, momentum,
// position), and every file that must not be resumed from is refused with a message
// that says why: another configuration, corruption, truncation, a weights file.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "core/error.h"
#include "models/loss.h"
#include "models/optim.h"
#include "models/zoo.h"
#include "tests/support/scoped_env.h"
#include "tests/support/solo_group.h"
#include "tests/trainer/ddp/counting_group.h"
#include "tests/trainer/temp_dir.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/checkpoint/checkpointer.h"
#include "trainer/checkpoint/checkpoint_file.h"
#include "trainer/checkpoint/safetensors.h"

using Catch::Matchers::Contains;
using mtrain::IoError;
using mtrain::RunConfiguration;
using mtrain::Tensor;
using mtrain::TrainPosition;
using mtrain::testing::TempDir;

namespace {

std::unique_ptr<mtrain::models::Module> make_mlp(uint64_t seed) {
  mtrain::models::InitOptions init;
  init.seed = seed;
  return mtrain::models::build_model("mlp", 1, 10, init);
}

mtrain::models::SgdOptions sgd_options() {
  mtrain::models::SgdOptions o;
  o.lr = 0.1f;
  o.momentum = 0.9f;
  return o;
}

// One SGD step on a fixed batch, so the momentum buffers exist and are not zero.
void train_one_step(mtrain::models::Module& model, mtrain::models::Sgd& sgd) {
  Tensor images = Tensor::zeros({4, 1, 28, 28});
  float* px = images.data<float>();
  for (int64_t i = 0; i < images.numel(); ++i) px[i] = static_cast<float>(i % 17) / 17.0f;
  const Tensor labels = Tensor::from_vector<int64_t>({1, 3, 5, 7}, {4});
  mtrain::models::CrossEntropyLoss loss;
  sgd.zero_grad();
  loss.forward(model.forward(images), labels);
  model.backward(loss.backward());
  sgd.step();
}

bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  return std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

const RunConfiguration kConfig = {{"--model", "mlp"}, {"--batch-size", "32"}, {"--lr", "0.1"}};

TrainPosition mid_epoch() {
  TrainPosition p;
  p.epoch = 2;
  p.steps_in_epoch = 7;
  p.total_steps = 31;
  p.loss_sum = 123.456789012345;
  p.correct = 140;
  p.images = 448;
  p.train_seconds = 0.25;
  p.world_size = 3;
  p.epoch_consumed = 7 * 32 * 3;
  return p;
}

// A checkpoint of a model after one step, in `dir`.
std::string write_checkpoint(const TempDir& dir, const RunConfiguration& config = kConfig) {
  auto model = make_mlp(1);
  mtrain::models::Sgd sgd(*model, sgd_options());
  train_one_step(*model, sgd);
  const std::string path = mtrain::checkpoint_path(dir.path().string());
  mtrain::save_training_checkpoint(path, *model, sgd, mid_epoch(), config);
  return path;
}

}  // namespace

TEST_CASE("a checkpoint restores the model, the momentum buffers and the position exactly") {
  TempDir dir;
  auto saved = make_mlp(1);
  mtrain::models::Sgd saved_sgd(*saved, sgd_options());
  train_one_step(*saved, saved_sgd);
  const std::string path = mtrain::checkpoint_path(dir.path().string());
  mtrain::save_training_checkpoint(path, *saved, saved_sgd, mid_epoch(), kConfig);

  auto restored = make_mlp(2);  // other initial weights, no momentum yet
  mtrain::models::Sgd restored_sgd(*restored, sgd_options());
  const TrainPosition p = mtrain::load_training_checkpoint(path, *restored, restored_sgd, kConfig);
  CHECK(p.epoch == 2);
  CHECK(p.steps_in_epoch == 7);
  CHECK(p.total_steps == 31);
  CHECK_FALSE(p.epoch_finished);
  CHECK(p.loss_sum == 123.456789012345);  // round-trips through its text form
  CHECK(p.correct == 140);
  CHECK(p.images == 448);
  CHECK(p.train_seconds == 0.25);
  CHECK(p.world_size == 3);
  CHECK(p.epoch_consumed == 672);

  const auto a = mtrain::model_state(*saved);
  const auto b = mtrain::model_state(*restored);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].first);
    CHECK(same_values(a[i].second, b[i].second));
  }
  const auto& ma = saved_sgd.momentum_buffers();
  const auto& mb = restored_sgd.momentum_buffers();
  REQUIRE(ma.size() == mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    REQUIRE(mb[i].defined());
    CHECK(same_values(ma[i], mb[i]));
  }

  // The next step from the restored state is the next step of the saved one.
  train_one_step(*saved, saved_sgd);
  train_one_step(*restored, restored_sgd);
  const auto a2 = mtrain::model_state(*saved);
  const auto b2 = mtrain::model_state(*restored);
  for (size_t i = 0; i < a2.size(); ++i) CHECK(same_values(a2[i].second, b2[i].second));
}

TEST_CASE("a checkpoint from another configuration is refused, naming every difference") {
  TempDir dir;
  const std::string path = write_checkpoint(dir);
  auto model = make_mlp(2);
  mtrain::models::Sgd sgd(*model, sgd_options());
  const auto before = mtrain::model_state(*model);
  std::vector<Tensor> copies;
  for (const auto& [name, t] : before) copies.push_back(t.clone());
  const RunConfiguration other = {{"--model", "mlp"}, {"--batch-size", "64"}, {"--lr", "0.2"}};
  try {
    mtrain::load_training_checkpoint(path, *model, sgd, other);
    FAIL("expected InvalidArgument");
  } catch (const mtrain::InvalidArgument& e) {
    CHECK_THAT(e.what(), Contains("different training configuration"));
    CHECK_THAT(e.what(), Contains("--batch-size is 64 here, 32 in the checkpoint"));
    CHECK_THAT(e.what(), Contains("--lr is 0.2 here, 0.1 in the checkpoint"));
    CHECK_THAT(e.what(), !Contains("--model"));
  }
  // Nothing was restored.
  const auto after = mtrain::model_state(*model);
  for (size_t i = 0; i < after.size(); ++i) CHECK(same_values(after[i].second, copies[i]));
  CHECK_FALSE(sgd.momentum_buffers()[0].defined());

  const RunConfiguration more = {{"--model", "mlp"}, {"--batch-size", "32"}, {"--lr", "0.1"}, {"--epochs", "3"}};
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, more),
                    Contains("--epochs is 3 here, unrecorded in the checkpoint"));
  const RunConfiguration fewer = {{"--model", "mlp"}, {"--batch-size", "32"}};
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, fewer),
                    Contains("--lr is 0.1 in the checkpoint, not a setting that must match here"));
}

TEST_CASE("a checkpoint from before resumes could change the world: its world from the configuration") {
  TempDir dir;
  // Written as mtrain-train wrote them then: the world as a setting that must match, no
  // position.world_size or epoch_consumed.
  RunConfiguration legacy = kConfig;
  legacy.emplace_back("world size", "2");
  const std::string path = write_checkpoint(dir, legacy);
  mtrain::SafetensorsFile file = mtrain::load_safetensors(path);
  file.metadata.erase("mtrain.position.world_size");
  file.metadata.erase("mtrain.position.epoch_consumed");
  file.metadata.erase(mtrain::kSafetensorsChecksumKey);
  mtrain::save_safetensors(path, file.tensors, file.metadata);
  auto model = make_mlp(2);
  mtrain::models::Sgd sgd(*model, sgd_options());
  // Resumed by a run that no longer lists the world among its settings.
  const TrainPosition p = mtrain::load_training_checkpoint(path, *model, sgd, kConfig);
  CHECK(p.world_size == 2);
  CHECK(p.epoch_consumed == -1);
}

TEST_CASE("a checkpoint from before --amp resumes as a run without it, and keeps the loss scaler's state") {
  TempDir dir;
  const std::string path = write_checkpoint(dir);  // no --amp, no --loss-scale recorded
  auto model = make_mlp(2);
  mtrain::models::Sgd sgd(*model, sgd_options());
  RunConfiguration now = kConfig;
  now.emplace_back("--amp", "off");
  now.emplace_back("--loss-scale", "none");
  CHECK(mtrain::load_training_checkpoint(path, *model, sgd, now).loss_scaler.scale == 0.0);
  now[3].second = "bf16";
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, now),
                    Contains("--amp is bf16 here, unrecorded in the checkpoint"));

  // A scaler's state round-trips exactly (the scale through its shortest text form).
  TempDir scaled_dir;
  auto saved = make_mlp(1);
  mtrain::models::Sgd saved_sgd(*saved, sgd_options());
  train_one_step(*saved, saved_sgd);
  TrainPosition p = mid_epoch();
  p.loss_scaler = {3.0517578125e-05, 17, 4, 3};
  const std::string scaled = mtrain::checkpoint_path(scaled_dir.path().string());
  mtrain::save_training_checkpoint(scaled, *saved, saved_sgd, p, kConfig);
  const TrainPosition back = mtrain::load_training_checkpoint(scaled, *model, sgd, kConfig);
  CHECK(back.loss_scaler.scale == 3.0517578125e-05);
  CHECK(back.loss_scaler.good_steps == 17);
  CHECK(back.loss_scaler.skipped_steps == 4);
  CHECK(back.loss_scaler.consecutive_skips == 3);

  // The growth interval decides which later steps are skipped: a checkpoint from before
  // it was recorded resumes only under the default.
  RunConfiguration scaled_now = kConfig;
  scaled_now.emplace_back("--loss-scale-growth-interval", "2000");
  CHECK_NOTHROW(mtrain::load_training_checkpoint(path, *model, sgd, scaled_now));
  scaled_now.back().second = "100";
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, scaled_now),
                    Contains("--loss-scale-growth-interval is 100 here, unrecorded in the checkpoint"));
}

TEST_CASE("a checkpoint from before streamed sets resumes under the image flags' defaults only") {
  TempDir dir;
  const std::string path = write_checkpoint(dir);  // none of the streamed sets' items recorded
  auto model = make_mlp(2);
  mtrain::models::Sgd sgd(*model, sgd_options());
  RunConfiguration now = kConfig;
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--random-resized-crop", "unset"}, {"--center-crop", "unset"}, {"--shuffle-buffer", "1000"},
           {"--full-decode", "off"}, {"--synthetic-shape", "1x28x28"}}) {
    now.emplace_back(flag, value);
  }
  CHECK_NOTHROW(mtrain::load_training_checkpoint(path, *model, sgd, now));
  now.back().second = "3x64x64";
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, now),
                    Contains("--synthetic-shape is 3x64x64 here, unrecorded in the checkpoint"));
}

TEST_CASE("an epoch's earlier worlds round-trip through a checkpoint") {
  TempDir dir;
  auto saved = make_mlp(1);
  mtrain::models::Sgd saved_sgd(*saved, sgd_options());
  train_one_step(*saved, saved_sgd);
  TrainPosition p = mid_epoch();
  p.earlier_segments = {{2, 48}, {3, 24}};
  const std::string path = mtrain::checkpoint_path(dir.path().string());
  mtrain::save_training_checkpoint(path, *saved, saved_sgd, p, kConfig);
  auto model = make_mlp(2);
  mtrain::models::Sgd sgd(*model, sgd_options());
  CHECK(mtrain::load_training_checkpoint(path, *model, sgd, kConfig).earlier_segments == p.earlier_segments);
  // A damaged list is named.
  auto file = mtrain::load_safetensors(path);
  file.metadata["mtrain.position.earlier_segments"] = "2:48,x";
  file.metadata.erase(mtrain::kSafetensorsChecksumKey);
  mtrain::save_safetensors(path, file.tensors, file.metadata);
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, kConfig),
                    Contains("\"mtrain.position.earlier_segments\" should be WORLD:ITEMS pairs, found '2:48,x'"));
}

TEST_CASE("a checkpoint whose steps were all skipped by the loss scaler resumes without momentum buffers") {
  // A skipped step counts in total_steps but never reaches the optimizer, which makes
  // its momentum buffers at its first applied step.
  TempDir dir;
  auto model = make_mlp(1);
  mtrain::models::Sgd sgd(*model, sgd_options());  // momentum 0.9, no step taken
  TrainPosition p = mid_epoch();
  p.epoch = 1;
  p.steps_in_epoch = 2;
  p.total_steps = 2;
  p.loss_scaler = {32768.0, 0, 2, 2};
  const std::string path = mtrain::checkpoint_path(dir.path().string());
  mtrain::save_training_checkpoint(path, *model, sgd, p, kConfig);
  auto restored = make_mlp(2);
  mtrain::models::Sgd restored_sgd(*restored, sgd_options());
  CHECK(mtrain::load_training_checkpoint(path, *restored, restored_sgd, kConfig).total_steps == 2);
  // One applied step among them needs the buffers.
  p.loss_scaler = {32768.0, 0, 1, 1};
  mtrain::save_training_checkpoint(path, *model, sgd, p, kConfig);
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *restored, restored_sgd, kConfig),
                    Contains("momentum buffers for 0 of the"));
}

TEST_CASE("the training set's fingerprint must match, unless the checkpoint predates it") {
  TempDir dir;
  RunConfiguration with_data = kConfig;
  with_data.emplace_back("training set fingerprint", "00000000000000aa");
  const std::string path = write_checkpoint(dir, with_data);
  auto model = make_mlp(2);
  mtrain::models::Sgd sgd(*model, sgd_options());
  CHECK_NOTHROW(mtrain::load_training_checkpoint(path, *model, sgd, with_data));
  RunConfiguration other_data = kConfig;
  other_data.emplace_back("training set fingerprint", "00000000000000bb");
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, other_data),
                    Contains("training set fingerprint is 00000000000000bb here, 00000000000000aa in the checkpoint"));
  // Written before fingerprints were recorded: any data of the right size resumes.
  TempDir old_dir;
  const std::string old = write_checkpoint(old_dir);
  CHECK_NOTHROW(mtrain::load_training_checkpoint(old, *model, sgd, other_data));
}

TEST_CASE("a corrupt or truncated checkpoint is refused with the file and the fault named") {
  TempDir dir;
  const std::string path = write_checkpoint(dir);
  auto model = make_mlp(2);
  mtrain::models::Sgd sgd(*model, sgd_options());
  const auto size = std::filesystem::file_size(path);

  SECTION("one flipped byte in the data") {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 3));
    const char c = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(size - 3));
    f.put(static_cast<char>(c ^ 0x5a));
    f.close();
    CHECK_THROWS_MATCHES(mtrain::load_training_checkpoint(path, *model, sgd, kConfig), IoError,
                         Catch::Matchers::Predicate<IoError>([&](const IoError& e) {
                           const std::string m = e.what();
                           return m.find("checksum mismatch") != std::string::npos &&
                                  m.find(path) != std::string::npos && m.find("--checkpoint-dir") != std::string::npos;
                         }, "names the checksum, the file and the way out"));
  }
  SECTION("cut short") {
    std::filesystem::resize_file(path, size / 2);
    CHECK_THROWS_AS(mtrain::load_training_checkpoint(path, *model, sgd, kConfig), IoError);
    CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, kConfig), Contains("truncated"));
  }
  SECTION("empty") {
    std::filesystem::resize_file(path, 0);
    CHECK_THROWS_AS(mtrain::load_training_checkpoint(path, *model, sgd, kConfig), IoError);
  }
  SECTION("a position that cannot be") {
    auto saved = make_mlp(1);
    mtrain::models::Sgd saved_sgd(*saved, sgd_options());
    train_one_step(*saved, saved_sgd);
    TrainPosition p = mid_epoch();
    p.correct = p.images + 1;
    mtrain::save_training_checkpoint(path, *saved, saved_sgd, p, kConfig);
    CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, kConfig),
                      Contains("449 images counted correct of 448 is impossible"));
    p = mid_epoch();
    p.loss_sum = std::numeric_limits<double>::infinity();
    mtrain::save_training_checkpoint(path, *saved, saved_sgd, p, kConfig);
    CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, kConfig),
                      Contains("\"mtrain.position.epoch_loss_sum\" should be a finite number >= 0, found inf"));
  }
}

TEST_CASE("resume refuses a checkpoint it cannot look at and clears interrupted saves") {
  TempDir dir;
  auto model = make_mlp(1);
  mtrain::models::Sgd sgd(*model, sgd_options());
  const std::string path = mtrain::checkpoint_path(dir.path().string());
  // A save killed before its rename left this behind (Note in trainer/checkpoint/checkpointer.cpp).
  const std::string stale = dir.file(".checkpoint.safetensors.tmp-4242-0");
  std::ofstream(stale) << "partial";
  const std::string unrelated = dir.file("notes.txt");
  std::ofstream(unrelated) << "kept";

  // Not "no checkpoint, start afresh": the first save would replace what the link names.
  std::filesystem::create_symlink(dir.file("elsewhere.safetensors"), path);
  mtrain::Checkpointer checkpointer(dir.path().string(), nullptr, 0, *model, sgd, kConfig);
  CHECK_THROWS_AS(checkpointer.resume(), IoError);
  CHECK_FALSE(std::filesystem::exists(stale));
  CHECK(std::filesystem::exists(unrelated));

  std::filesystem::remove(path);
  CHECK_FALSE(checkpointer.resume().has_value());
}

namespace {

// The total_steps a checkpoint file records (it must pass its checks).
int64_t saved_steps(const std::string& path) {
  return std::stoll(mtrain::load_safetensors(path).metadata.at("mtrain.position.total_steps"));
}

TrainPosition at_step(int64_t steps) {
  TrainPosition p = mid_epoch();
  p.total_steps = steps;
  return p;
}

void flip_a_byte(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-5, std::ios::end);
  f.put('\x7f');
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

// Note [The previous checkpoint] in trainer/checkpoint/checkpointer.cpp.
TEST_CASE("a damaged latest checkpoint is set aside, never rotated over the good previous one") {
  TempDir dir;
  const std::string d = dir.path().string();
  const std::string latest = mtrain::checkpoint_path(d), previous = mtrain::previous_checkpoint_path(d);
  const std::string damaged = mtrain::damaged_checkpoint_path(d);
  auto model = make_mlp(1);
  mtrain::models::Sgd sgd(*model, sgd_options());
  train_one_step(*model, sgd);
  {
    mtrain::Checkpointer first(d, nullptr, 0, *model, sgd, kConfig);
    CHECK_FALSE(first.resume().has_value());
    first.save(at_step(10), mtrain::CheckpointReason::kEvery);
    first.save(at_step(20), mtrain::CheckpointReason::kEvery);
  }
  CHECK(saved_steps(latest) == 20);
  CHECK(saved_steps(previous) == 10);

  SECTION("damaged before a resume") {
    flip_a_byte(latest);
    const std::string bad = bytes_of(latest);
    mtrain::Checkpointer second(d, nullptr, 0, *model, sgd, kConfig);
    const auto position = second.resume();
    REQUIRE(position.has_value());
    CHECK(position->total_steps == 10);
    CHECK(second.resumed_from() == previous);
    CHECK(bytes_of(damaged) == bad);
    CHECK_FALSE(std::filesystem::exists(latest));
    second.save(at_step(15), mtrain::CheckpointReason::kStop);
    CHECK(saved_steps(latest) == 15);
    CHECK(saved_steps(previous) == 10);  // the good one, not the damaged file
    second.save(at_step(20), mtrain::CheckpointReason::kEvery);
    CHECK(saved_steps(latest) == 20);
    CHECK(saved_steps(previous) == 15);
  }
  SECTION("a latest the run resumed from moves to the previous slot unread") {
    mtrain::Checkpointer second(d, nullptr, 0, *model, sgd, kConfig);
    REQUIRE(second.resume().has_value());
    CHECK(second.resumed_from() == latest);
    // The run checked it when it resumed, so its save moves it without reading it again.
    second.save(at_step(30), mtrain::CheckpointReason::kEvery);
    CHECK(saved_steps(previous) == 20);
  }
  SECTION("a latest this run did not check is checked before it moves") {
    mtrain::Checkpointer second(d, nullptr, 0, *model, sgd, kConfig);
    flip_a_byte(latest);  // never resumed: the save finds it damaged
    second.save(at_step(30), mtrain::CheckpointReason::kEvery);
    CHECK(saved_steps(latest) == 30);
    CHECK(saved_steps(previous) == 10);
    CHECK(std::filesystem::exists(damaged));
  }
  SECTION("a save killed before its new file moved into place leaves it, and the next start removes it") {
    std::filesystem::copy_file(latest, mtrain::incoming_checkpoint_path(d));
    std::ofstream(dir.file(".checkpoint.incoming.safetensors.tmp-99-0")) << "partial";
    mtrain::Checkpointer second(d, nullptr, 0, *model, sgd, kConfig);
    REQUIRE(second.resume().has_value());
    CHECK_FALSE(std::filesystem::exists(mtrain::incoming_checkpoint_path(d)));
    CHECK_FALSE(std::filesystem::exists(dir.file(".checkpoint.incoming.safetensors.tmp-99-0")));
    CHECK(saved_steps(latest) == 20);
  }
}

// Note [Room for the outputs] in trainer/setup/start_up.cpp: a finished run's weights
// survive a final write that fails.
TEST_CASE("final weights that cannot be written where asked are kept in the temporary directory") {
  TempDir dir;
  const mtrain::testing::ScopedEnv tmpdir("TMPDIR", dir.path().string());
  auto model = make_mlp(1);
  const std::string asked = dir.file("gone/final.safetensors");  // no such directory
  const std::string kept = dir.file(fmt::format("mtrain-final-{}.safetensors", ::getpid()));
  CHECK_THROWS_WITH(mtrain::save_model_weights_or_keep(asked, *model), Contains(asked) &&
                                                                            Contains("the weights are kept in " + kept));
  auto reloaded = make_mlp(2);
  mtrain::load_model_weights(kept, *reloaded);
  CHECK(same_values(reloaded->parameters()[0].param->value, model->parameters()[0].param->value));
  // Written where asked, nothing is kept elsewhere.
  std::filesystem::remove(kept);
  CHECK_NOTHROW(mtrain::save_model_weights_or_keep(dir.file("final.safetensors"), *model));
  CHECK_FALSE(std::filesystem::exists(kept));
}

TEST_CASE("a weights file, or a checkpoint with missing momentum, is not resumed from") {
  TempDir dir;
  auto model = make_mlp(1);
  mtrain::models::Sgd sgd(*model, sgd_options());
  const std::string path = mtrain::checkpoint_path(dir.path().string());

  mtrain::save_model_weights(path, *model, {{mtrain::kWeightsModelKey, "mlp"}});
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, kConfig),
                    Contains("is not a training checkpoint") && Contains("--init-from"));

  // Saved before any step (no momentum yet) but claiming 31 steps with momentum 0.9.
  mtrain::save_training_checkpoint(path, *model, sgd, mid_epoch(), kConfig);
  CHECK_THROWS_WITH(mtrain::load_training_checkpoint(path, *model, sgd, kConfig),
                    Contains("momentum buffers for 0 of the"));
}

TEST_CASE("a checkpointer sends host values on the control group, model state on the gradient group") {
  // Note [Control-plane collectives] in trainer/ddp/training_groups.cpp: under NCCL the model
  // state is on the GPU and the headers are host tensors, so they need different groups.
  TempDir dir;
  mtrain::testing::SoloGroup solo_gradients;
  mtrain::testing::SoloGroup solo_control;
  mtrain::testing::CountingGroup gradients(solo_gradients.group);
  mtrain::testing::CountingGroup control(solo_control.group);
  auto model = make_mlp(1);
  mtrain::models::Sgd sgd(*model, sgd_options());
  mtrain::Checkpointer checkpointer(dir.path().string(), &gradients, 0, *model, sgd, kConfig, &control);

  REQUIRE_FALSE(checkpointer.resume().has_value());  // nothing to resume yet
  CHECK(control.broadcasts == 2);  // the outcome, then the header saying "none found"
  CHECK(gradients.broadcasts == 0);

  train_one_step(*model, sgd);
  checkpointer.save(mid_epoch(), mtrain::CheckpointReason::kEvery);
  CHECK(control.allreduces == 1);  // the epoch's counts
  CHECK(control.allgathers == 1);  // its loss sum, in double (sum_over_ranks)
  CHECK(control.broadcasts == 3);  // and the outcome of the write
  CHECK(gradients.allreduces + gradients.broadcasts + gradients.allgathers == 0);

  auto restored = make_mlp(2);
  mtrain::models::Sgd restored_sgd(*restored, sgd_options());
  mtrain::testing::CountingGroup gradients2(solo_gradients.group);
  mtrain::testing::CountingGroup control2(solo_control.group);
  mtrain::Checkpointer resumer(dir.path().string(), &gradients2, 0, *restored, restored_sgd, kConfig, &control2);
  const auto position = resumer.resume();
  REQUIRE(position.has_value());
  CHECK(position->total_steps == mid_epoch().total_steps);
  CHECK(control2.broadcasts == 2);  // outcome and header
  // The model state (one flat float32 broadcast: mlp has no int64 buffers) and one
  // momentum buffer per parameter.
  CHECK(gradients2.broadcasts == 1 + static_cast<int>(restored->parameters().size()));
  const auto a = mtrain::model_state(*model);
  const auto b = mtrain::model_state(*restored);
  for (size_t i = 0; i < a.size(); ++i) CHECK(same_values(a[i].second, b[i].second));
}
