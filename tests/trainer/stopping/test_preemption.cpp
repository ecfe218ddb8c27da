// Checkpoints and preemption end to end, with the real binaries: a run interrupted and
// resumed ends with the same weights as one that was not; a stop signal to one worker,
// or SIGUSR1 to the launcher, stops every rank after the same step with a checkpoint,
// the message and the launcher's stop report; a restarted gang resumes; checkpoints
// that must not be resumed are refused with the exit status of their kind.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <thread>

#include "core/main_guard.h"
#include "tests/support/held_port.h"
#include "tests/trainer/background_process.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "tests/trainer/weights_compare.h"
#include "trainer/loop/lr_schedule.h"
#include "trainer/checkpoint/safetensors.h"

using Catch::Matchers::Contains;
using mtrain::testing::BackgroundProcess;
using mtrain::testing::HeldPort;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;
using mtrain::testing::kLauncher;
using mtrain::testing::kTrainer;
using mtrain::testing::kMiniSet;
using mtrain::testing::concat;

namespace {


// mlp on the shipped subset without evaluation: about a millisecond per step.
std::vector<std::string> train_args(const std::vector<std::string>& extra) {
  return concat({"--model", "mlp", "--no-eval", "--threads", "1", "--log-level", "warn", "--data-dir", kMiniSet},
                extra);
}

ProcessResult train(const std::vector<std::string>& extra) {
  return mtrain::testing::run_process(kTrainer, train_args(extra));
}

std::vector<std::string> launch_args(int nproc, const std::string& entry, const std::vector<std::string>& extra) {
  return concat({fmt::format("--nproc_per_node={}", nproc), "--term_timeout=20", entry}, train_args(extra));
}

ProcessResult launch(int nproc, const std::vector<std::string>& extra) {
  return mtrain::testing::run_process(kLauncher, launch_args(nproc, "train", extra));
}

void require_exit(const ProcessResult& r, int code) {
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == code);
}

// Every tensor of the two files has the same bytes: resuming must not change one bit.
void require_identical_weights(const std::string& a_path, const std::string& b_path) {
  const auto d = mtrain::testing::compare_weights(a_path, b_path);
  INFO(d.describe());
  CHECK(d.identical());
}

// A whole file's bytes.
std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int64_t checkpoint_total_steps(const std::string& path) {
  return std::stoll(mtrain::load_safetensors(path).metadata.at("mtrain.position.total_steps"));
}

// A worker wrapper that records its pid as DIR/pid.<RANK>, so a test can signal one rank.
std::string pid_recording_worker(const TempDir& dir) {
  const std::string path = dir.file("worker.sh");
  std::ofstream out(path);
  out << "#!/bin/sh\necho $$ > " << dir.file("pid.") << "$RANK\nexec " << kTrainer << " \"$@\"\n";
  out.close();
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

pid_t read_pid(const std::string& path) {
  std::ifstream in(path);
  long pid = 0;
  in >> pid;
  return static_cast<pid_t>(pid);
}

// The step each rank of the stop report says it stopped after, by rank.
std::map<int, int64_t> reported_stop_steps(const std::string& report, const std::string& signal) {
  std::map<int, int64_t> steps;
  const std::regex line(R"(rank (\d+) \(local_rank \d+, node 0\): stopped after step (\d+) \(epoch \d+\) on )" +
                        signal);
  for (auto it = std::sregex_iterator(report.begin(), report.end(), line); it != std::sregex_iterator(); ++it) {
    steps[std::stoi((*it)[1])] = std::stoll((*it)[2]);
  }
  return steps;
}

// Starts a long 2-rank run with checkpoints, waits until it has written one (so it is
// training), lets `interrupt` signal it, and returns the launcher's result.
ProcessResult interrupt_two_ranks(const TempDir& dir, const std::string& ckpt,
                                  const std::function<void(BackgroundProcess&)>& interrupt) {
  BackgroundProcess launcher(kLauncher, launch_args(2, pid_recording_worker(dir),
                                                    {"--epochs", "30", "--batch-size", "32", "--checkpoint-dir", ckpt,
                                                     "--checkpoint-every", "20"}));
  const std::string first = ckpt + "/checkpoint.safetensors";
  const bool training = mtrain::testing::wait_until(
      [&] { return std::filesystem::exists(first) && std::filesystem::exists(dir.file("pid.1")); },
      std::chrono::seconds(60));
  if (!training) {
    launcher.signal(SIGKILL);
    const ProcessResult r = launcher.wait();
    INFO("stderr:\n" << r.err);
    FAIL("the run wrote no checkpoint within a minute");
  }
  interrupt(launcher);
  return launcher.wait();
}

}  // namespace

TEST_CASE("one process: a run resumed from its checkpoint ends with the uninterrupted run's weights",
          "[multiproc]") {
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  const std::vector<std::string> base = {"--batch-size", "256"};  // 24 steps per epoch
  require_exit(train(concat(base, {"--max-steps", "30", "--save-final", dir.file("straight.safetensors")})), 0);
  // Interrupted mid-epoch 1 (--max-steps is the length of the run, and a constant rate
  // lets a resumed run extend it), then run on across the epoch boundary.
  const auto metrics = dir.file("metrics.jsonl");
  const std::vector<std::string> logged = {"--metrics", metrics, "--log-every", "5"};
  require_exit(train(concat(concat(base, logged),
                            {"--max-steps", "10", "--checkpoint-dir", ckpt, "--checkpoint-every", "4"})),
               0);
  CHECK(checkpoint_total_steps(ckpt + "/checkpoint.safetensors") == 10);
  const auto resumed = train(concat(concat(base, logged), {"--max-steps", "30", "--checkpoint-dir", ckpt, "--log-level",
                                                           "info", "--save-final", dir.file("resumed.safetensors")}));
  require_exit(resumed, 0);
  // The epoch was summarised at the --max-steps cut; the log says it is not done.
  CHECK_THAT(resumed.err + resumed.out,
             Contains("resuming from " + ckpt +
                      "/checkpoint.safetensors: epoch 1 stopped by --max-steps after 10 of its 24 steps; the rest of "
                      "it follows, 10 steps in total"));
  CHECK(checkpoint_total_steps(ckpt + "/checkpoint.safetensors") == 30);
  require_identical_weights(dir.file("straight.safetensors"), dir.file("resumed.safetensors"));

  // The resumed run continues the metrics file rather than erasing the first run's events.
  // Epoch events say what they cover: epoch 1 cut at step 10, its other 14 steps after
  // the resume (the last with the 112 images left of 6000), and 6 steps of epoch 2.
  std::ifstream in(metrics);
  std::vector<int64_t> step_events;
  std::vector<std::tuple<int64_t, int64_t, int64_t, bool>> epoch_events;  // epoch, steps, images, partial
  for (std::string line; std::getline(in, line);) {
    const auto event = nlohmann::json::parse(line);
    if (event.at("event") == "step") step_events.push_back(event.at("step").get<int64_t>());
    if (event.at("event") == "epoch") {
      epoch_events.emplace_back(event.at("epoch").get<int64_t>(), event.at("steps").get<int64_t>(),
                                event.at("images").get<int64_t>(), event.at("partial").get<bool>());
    }
  }
  CHECK(step_events == std::vector<int64_t>{5, 10, 15, 20, 25, 30});
  using Epoch = std::tuple<int64_t, int64_t, int64_t, bool>;
  CHECK(epoch_events ==
        std::vector<Epoch>{Epoch{1, 10, 2560, true}, Epoch{1, 14, 13 * 256 + 112, true}, Epoch{2, 6, 1536, true}});
}

TEST_CASE("augmented: a resumed run draws the crops and flips the uninterrupted one drew", "[multiproc]") {
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  // 24 steps per epoch: the resume lands mid-epoch 1 and the run crosses into epoch 2,
  // whose draws differ from epoch 1's.
  const std::vector<std::string> base = {"--batch-size", "256", "--random-crop", "3", "--random-flip",
                                         "--normalize", "auto"};
  require_exit(train(concat(base, {"--max-steps", "30", "--save-final", dir.file("straight.safetensors")})), 0);
  require_exit(train(concat(base, {"--max-steps", "10", "--checkpoint-dir", ckpt, "--checkpoint-every", "4"})), 0);
  CHECK(checkpoint_total_steps(ckpt + "/checkpoint.safetensors") == 10);
  require_exit(train(concat(base, {"--max-steps", "30", "--checkpoint-dir", ckpt, "--save-final",
                                   dir.file("resumed.safetensors")})),
               0);
  CHECK(checkpoint_total_steps(ckpt + "/checkpoint.safetensors") == 30);
  require_identical_weights(dir.file("straight.safetensors"), dir.file("resumed.safetensors"));
  // And the augmentation mattered: without it the same 30 steps end elsewhere.
  require_exit(train({"--batch-size", "256", "--normalize", "auto", "--max-steps", "30", "--save-final",
                      dir.file("plain.safetensors")}),
               0);
  CHECK_FALSE(mtrain::testing::compare_weights(dir.file("straight.safetensors"), dir.file("plain.safetensors"))
                  .identical());
}

namespace {

// Every step event's "lr" by step (with --log-every 1, the rate of that step).
std::map<int64_t, double> step_rates(const std::string& metrics) {
  std::map<int64_t, double> rates;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto event = nlohmann::json::parse(line);
    if (event.at("event") == "step") rates[event.at("step").get<int64_t>()] = event.at("lr").get<double>();
  }
  return rates;
}

}  // namespace

TEST_CASE("cosine with warm-up: each step's rate follows the schedule, and a run stopped by SIGTERM resumes to "
          "the same weights and rates",
          "[multiproc]") {
  // 6000 images in batches of 32: 188 steps per epoch, 1504 in the run. The rate of a
  // step is set from the progress before it (Note [Learning-rate scaling and warm-up]).
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  const std::vector<std::string> base = {"--epochs", "8", "--batch-size", "32", "--lr-schedule", "cosine",
                                         "--warmup-epochs", "0.5", "--log-every", "1"};
  const auto straight_metrics = dir.file("straight.jsonl");
  require_exit(train(concat(base, {"--metrics", straight_metrics, "--save-final", dir.file("straight.safetensors")})),
               0);
  mtrain::LrScheduleOptions o;
  o.base_lr = 0.1;
  o.warmup_epochs = 0.5;
  o.total_epochs = 8.0;
  o.kind = mtrain::LrScheduleKind::Cosine;
  const mtrain::LrSchedule schedule(o);
  const auto straight = step_rates(straight_metrics);
  REQUIRE(straight.size() == 1504);
  for (const auto& [step, lr] : straight) {
    INFO("step " << step);
    REQUIRE(lr == static_cast<double>(static_cast<float>(schedule.at(static_cast<double>(step - 1) / 188.0))));
  }

  const auto resumed_metrics = dir.file("resumed.jsonl");
  const std::vector<std::string> resumable = concat(base, {"--metrics", resumed_metrics, "--checkpoint-dir", ckpt});
  BackgroundProcess first(kTrainer, train_args(concat(resumable, {"--checkpoint-every", "20"})));
  REQUIRE(mtrain::testing::wait_until([&] { return std::filesystem::exists(ckpt + "/checkpoint.safetensors"); },
                                      std::chrono::seconds(60)));
  first.signal(SIGTERM);
  require_exit(first.wait(), mtrain::kStoppedExitCode);
  const int64_t stopped_at = checkpoint_total_steps(ckpt + "/checkpoint.safetensors");
  CHECK(stopped_at < 1504);
  require_exit(train(concat(resumable, {"--save-final", dir.file("resumed.safetensors")})), 0);
  require_identical_weights(dir.file("straight.safetensors"), dir.file("resumed.safetensors"));
  const auto resumed = step_rates(resumed_metrics);  // both attempts' events
  REQUIRE(resumed.size() == 1504);
  CHECK(resumed == straight);
}

TEST_CASE("two ranks (Gloo, gradient accumulation): resumed equals uninterrupted", "[multiproc]") {
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  // 3000 images per rank in micro-batches of 64, two per step: 24 steps per epoch.
  const std::vector<std::string> base = {"--batch-size", "64", "--grad-accum", "2"};
  require_exit(launch(2, concat(base, {"--max-steps", "30", "--save-final", dir.file("straight.safetensors")})), 0);
  require_exit(launch(2, concat(base, {"--max-steps", "11", "--checkpoint-dir", ckpt, "--checkpoint-every", "5"})), 0);
  require_exit(launch(2, concat(base, {"--max-steps", "30", "--checkpoint-dir", ckpt, "--save-final",
                                       dir.file("resumed.safetensors")})),
               0);
  require_identical_weights(dir.file("straight.safetensors"), dir.file("resumed.safetensors"));
}

TEST_CASE("one process: SIGTERM stops it after a step with a checkpoint and exit status 75", "[multiproc]") {
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  BackgroundProcess trainer(kTrainer, train_args({"--epochs", "30", "--batch-size", "32", "--checkpoint-dir", ckpt,
                                                  "--checkpoint-every", "20"}));
  REQUIRE(mtrain::testing::wait_until([&] { return std::filesystem::exists(ckpt + "/checkpoint.safetensors"); },
                                      std::chrono::seconds(60)));
  trainer.signal(SIGTERM);
  const ProcessResult r = trainer.wait();
  require_exit(r, mtrain::kStoppedExitCode);
  const std::regex message(R"(received SIGTERM: stopped after step (\d+) \(epoch (\d+)\), checkpoint written to )" +
                           ckpt + "/checkpoint.safetensors");
  std::smatch m;
  const std::string output = r.out + r.err;
  REQUIRE(std::regex_search(output, m, message));
  const int64_t stopped = std::stoll(m[1]);
  CHECK(checkpoint_total_steps(ckpt + "/checkpoint.safetensors") == stopped);
  // Acknowledged at once, before the stop, with the steps it could stop after.
  const std::regex acknowledged(
      R"(received SIGTERM with (\d+) steps done: stopping after step (\d+) or (\d+), then a checkpoint follows)");
  std::smatch a;
  REQUIRE(std::regex_search(output, a, acknowledged));
  CHECK(a.position(0) < m.position(0));
  const int64_t done = std::stoll(a[1]);
  CHECK(std::stoll(a[2]) == done + 1);
  CHECK((stopped == done + 1 || stopped == done + 2));
}

TEST_CASE("SIGTERM to one of two workers: both stop after the same step; resuming finishes the run",
          "[multiproc]") {
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  const ProcessResult r = interrupt_two_ranks(dir, ckpt, [&](BackgroundProcess&) {
    REQUIRE(::kill(read_pid(dir.file("pid.1")), SIGTERM) == 0);
  });
  require_exit(r, mtrain::kStoppedExitCode);
  INFO(r.err);
  const auto steps = reported_stop_steps(r.err, "SIGTERM \\(received by rank 1\\)");
  REQUIRE(steps.size() == 2);
  const int64_t step = steps.at(0);
  CHECK(steps.at(1) == step);
  CHECK_THAT(r.out + r.err, Contains(fmt::format("rank 1 received SIGTERM: stopped after step {} (epoch ", step)));
  CHECK_THAT(r.err, Contains("STOPPED on a signal"));
  CHECK_THAT(r.err, Contains("Checkpoint : " + ckpt + "/checkpoint.safetensors"));
  CHECK_THAT(r.err, !Contains("FAILED"));
  CHECK(checkpoint_total_steps(ckpt + "/checkpoint.safetensors") == step);

  // Resumed to a few steps further, it matches a run that went there in one go.
  const std::vector<std::string> rest = {"--epochs", "30", "--batch-size", "32",
                                         "--max-steps", std::to_string(step + 3)};
  const auto resumed_metrics = dir.file("resumed.jsonl"), straight_metrics = dir.file("straight.jsonl");
  require_exit(launch(2, concat(rest, {"--checkpoint-dir", ckpt, "--save-final", dir.file("resumed.safetensors"),
                                       "--metrics", resumed_metrics})),
               0);
  CHECK(checkpoint_total_steps(ckpt + "/checkpoint.safetensors") == step + 3);
  require_exit(launch(2, concat(rest, {"--save-final", dir.file("straight.safetensors"), "--metrics", straight_metrics})),
               0);
  require_identical_weights(dir.file("straight.safetensors"), dir.file("resumed.safetensors"));
  // The epoch in progress: its loss sums up to the stop crossed the ranks in the
  // checkpoint, in double (sum_over_ranks), so only the order of the additions differs
  // from the run in one go (a float32 all-reduce differed in the 7th digit).
  const auto last_epoch = [](const std::string& metrics) {
    std::ifstream in(metrics);
    nlohmann::json last;
    for (std::string line; std::getline(in, line);) {
      auto event = nlohmann::json::parse(line);
      if (event.at("event") == "epoch") last = std::move(event);
    }
    return last;
  };
  const auto resumed = last_epoch(resumed_metrics), straight = last_epoch(straight_metrics);
  INFO("resumed " << resumed.dump() << "\nstraight " << straight.dump());
  REQUIRE(resumed.at("epoch") == straight.at("epoch"));
  CHECK(resumed.at("train_acc") == straight.at("train_acc"));
  const double a = resumed.at("train_loss").get<double>(), b = straight.at("train_loss").get<double>();
  CHECK(std::abs(a - b) <= 1e-12 * std::abs(b));
}

namespace {

// Whether process `pid` blocks SIGTERM in its main thread, as mtrain-train does from its
// first lines on (install_stop_signal_handlers): from then on a SIGTERM is its to handle.
bool handles_stop_signals(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("SigBlk:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> (SIGTERM - 1)) & 1;
  }
  return false;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

}  // namespace

// Note [A stop signal during start-up] (trainer/stopping/stop_signals.cpp): before its first step a
// worker may wait for its peers for --timeout; the first signal must end that wait.
TEST_CASE("one worker waiting for its peers at start-up stops at once on the first SIGTERM", "[multiproc]") {
  TempDir dir;
  HeldPort port;
  const auto ckpt = dir.file("ckpt");
  // Rank 1 dials a store nobody serves; rank 0 serves it and waits for rank 1 to join.
  for (const int rank : {1, 0}) {
    INFO("rank " << rank << " alone in a world of 2");
    if (rank == 0) port.release();
    const std::string error_file = dir.file(fmt::format("error.{}.json", rank));
    BackgroundProcess worker(
        "/usr/bin/env",
        concat({fmt::format("RANK={}", rank), "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                fmt::format("MASTER_PORT={}", port.port()), "MTRAIN_STORE_TOKEN=t", "MTRAIN_ERROR_FILE=" + error_file,
                kTrainer},
               train_args({"--timeout", "600", "--checkpoint-dir", ckpt})));
    REQUIRE(mtrain::testing::wait_until([&] { return handles_stop_signals(worker.pid()); }, std::chrono::seconds(30)));
    // Into the wait (a signal before it would be taken at once too); nothing else ends it.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    REQUIRE(worker.running());
    const auto signalled = std::chrono::steady_clock::now();
    worker.signal(SIGTERM);
    const ProcessResult r = worker.wait();
    require_exit(r, mtrain::kStoppedExitCode);
    CHECK(std::chrono::steady_clock::now() - signalled < std::chrono::seconds(10));
    CHECK_THAT(r.out + r.err, Contains("received SIGTERM during start-up, before the first step: stopped at once; no "
                               "checkpoint to resume from"));
    const auto record = read_json(error_file);
    INFO(record.dump());
    CHECK(record.at("rank") == rank);
    CHECK(record.at("stopped").at("signal") == "SIGTERM");
    CHECK(record.at("stopped").at("during_startup") == true);
    CHECK(record.at("stopped").at("checkpoint") == "");
  }
}

// The launcher passes a start-up stop on to the other workers, which would wait for the
// stopped one until --timeout; the report says where every rank stopped.
TEST_CASE("SIGTERM to one worker stuck at start-up: the launcher stops its peers, the report says so",
          "[multiproc]") {
  TempDir dir;
  HeldPort port;
  // Rank 1 dials a store nobody serves instead of the launcher's, so neither rank gets
  // past start-up. In the second section rank 0 is still its wrapper, sleeping before
  // it starts the trainer, so the SIGTERM the launcher sends it kills it outright.
  const bool rank0_late = GENERATE(false, true);
  INFO((rank0_late ? "rank 0 not started yet" : "rank 0 waiting for rank 1"));
  const std::string wrapper = dir.file("stuck.sh");
  {
    std::ofstream out(wrapper);
    out << "#!/bin/sh\necho $$ > " << dir.file("pid.") << "$RANK\n"
        << "if [ \"$RANK\" = 1 ]; then unset MTRAIN_RUN_ID; export MASTER_PORT=" << port.port() << "; fi\n"
        << (rank0_late ? "if [ \"$RANK\" = 0 ]; then sleep 60; fi\n" : "") << "exec " << kTrainer << " \"$@\"\n";
  }
  std::filesystem::permissions(wrapper, std::filesystem::perms::owner_all);
  BackgroundProcess launcher(kLauncher, launch_args(2, wrapper, {"--timeout", "600"}));
  // The ranks that run the trainer must be it, not yet the wrapper, when the signals come.
  REQUIRE(mtrain::testing::wait_until(
      [&] {
        return std::filesystem::exists(dir.file("pid.0")) && std::filesystem::exists(dir.file("pid.1")) &&
               (rank0_late || handles_stop_signals(read_pid(dir.file("pid.0")))) &&
               handles_stop_signals(read_pid(dir.file("pid.1")));
      },
      std::chrono::seconds(30)));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto signalled = std::chrono::steady_clock::now();
  REQUIRE(::kill(read_pid(dir.file("pid.1")), SIGTERM) == 0);
  const ProcessResult r = launcher.wait();
  require_exit(r, mtrain::kStoppedExitCode);
  // Well inside --term_timeout (20 s), after which the launcher would call it a failure.
  CHECK(std::chrono::steady_clock::now() - signalled < std::chrono::seconds(15));
  INFO(r.err);
  CHECK_THAT(r.err, Contains("STOPPED on a signal"));
  CHECK_THAT(r.err, Contains("Every worker stopped:"));
  // A rank killed by that SIGTERM before it could handle it stopped alongside rank 1.
  CHECK_THAT(r.err, Contains(fmt::format("rank 0 (local_rank 0, node 0): stopped during start-up, before its first "
                                         "step, on SIGTERM (received by rank {})",
                                         rank0_late ? 1 : 0)));
  CHECK_THAT(r.err, Contains("rank 1 (local_rank 1, node 0): stopped during start-up, before its first step, on "
                             "SIGTERM (received by rank 1)"));
  CHECK_THAT(r.err, Contains("Checkpoint : none yet (the workers stopped before their first step)"));
  CHECK_THAT(r.err, !Contains("FAILED"));
}

TEST_CASE("SIGUSR1 to the launcher: forwarded, every rank stops after the same step, the report says so",
          "[multiproc]") {
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  const ProcessResult r =
      interrupt_two_ranks(dir, ckpt, [](BackgroundProcess& launcher) { launcher.signal(SIGUSR1); });
  require_exit(r, mtrain::kStoppedExitCode);
  INFO(r.err);
  CHECK_THAT(r.err, Contains("The launcher received SIGUSR1 and forwarded it to the workers."));
  const auto steps = reported_stop_steps(r.err, "SIGUSR1");
  REQUIRE(steps.size() == 2);
  CHECK(steps.at(0) == steps.at(1));
  CHECK_THAT(r.out + r.err, Contains(fmt::format("received SIGUSR1: stopped after step {} (epoch ", steps.at(0))));
  CHECK(checkpoint_total_steps(ckpt + "/checkpoint.safetensors") == steps.at(0));
  const auto resumed = launch(2, {"--epochs", "30", "--batch-size", "32", "--checkpoint-dir", ckpt, "--max-steps",
                                  std::to_string(steps.at(0) + 2)});
  require_exit(resumed, 0);
}

TEST_CASE("--max_restarts: a gang restarted after a crash resumes from the last checkpoint", "[multiproc]") {
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  // Rank 1 of the first attempt dies (SIGKILL) once the first checkpoint exists.
  const std::string worker = dir.file("crashing_worker.sh");
  {
    std::ofstream out(worker);
    out << "#!/bin/sh\n"
        << "if [ \"$MTRAIN_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then\n"
        << "  " << kTrainer << " \"$@\" & child=$!\n"
        << "  while [ ! -f " << ckpt << "/checkpoint.safetensors ]; do sleep 0.02; done\n"
        << "  kill -9 $child; exit 1\n"
        << "fi\n"
        << "exec " << kTrainer << " \"$@\"\n";
  }
  std::filesystem::permissions(worker, std::filesystem::perms::owner_all);
  const std::vector<std::string> run = {"--batch-size", "64", "--max-steps", "40"};
  const auto restarted = mtrain::testing::run_process(
      kLauncher, concat({"--nproc_per_node=2", "--max_restarts=1", "--term_timeout=5", worker},
                        train_args(concat(run, {"--checkpoint-dir", ckpt, "--checkpoint-every", "10", "--log-level",
                                                "info", "--save-final", dir.file("restarted.safetensors")}))));
  require_exit(restarted, 0);
  INFO(restarted.err);
  CHECK_THAT(restarted.err, Contains("restarting the gang"));
  CHECK_THAT(restarted.err + restarted.out, Contains("resuming from " + ckpt + "/checkpoint.safetensors"));
  require_exit(launch(2, concat(run, {"--save-final", dir.file("straight.safetensors")})), 0);
  require_identical_weights(dir.file("straight.safetensors"), dir.file("restarted.safetensors"));
}

TEST_CASE("checkpoints that must not be resumed: another configuration (exit 2), a corrupt file (exit 1)",
          "[multiproc]") {
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  const auto path = ckpt + "/checkpoint.safetensors";
  require_exit(train({"--batch-size", "32", "--max-steps", "2", "--checkpoint-dir", ckpt}), 0);

  const auto other_batch = train({"--batch-size", "64", "--max-steps", "4", "--checkpoint-dir", ckpt});
  require_exit(other_batch, 2);
  CHECK_THAT(other_batch.err, Contains("--batch-size is 64 here, 32 in the checkpoint"));

  // On 2 ranks (another world is allowed: Note [Resuming in another world]).
  const auto other_world = launch(2, {"--batch-size", "32", "--lr", "0.5", "--max-steps", "4", "--checkpoint-dir", ckpt});
  CHECK(other_world.exit_code == 2);
  CHECK_THAT(other_world.err, Contains("--lr is 0.5 here, 0.1 in the checkpoint"));
  // Both ranks raise rank 0's error: the root cause names the reason whichever is first.
  CHECK_THAT(other_world.err, Contains("Root cause") && Contains("message    : ") && !Contains("its error says"));

  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  const auto corrupt = train({"--batch-size", "32", "--max-steps", "4", "--checkpoint-dir", ckpt});
  require_exit(corrupt, 1);
  CHECK_THAT(corrupt.err, Contains("cannot resume from the checkpoint") && Contains("checksum mismatch") &&
                              Contains(path));
}

namespace {

// A 2-rank run that trains until it is interrupted: returns once both ranks are past
// their first steps (a step event in the metrics, each rank's pid recorded).
struct TrainingGang {
  std::unique_ptr<BackgroundProcess> launcher;
  pid_t rank0 = 0, rank1 = 0;
};

TrainingGang start_training_gang(const TempDir& dir, const std::vector<std::string>& extra) {
  const std::string metrics = dir.file("gang.jsonl");
  TrainingGang g;
  g.launcher = std::make_unique<BackgroundProcess>(
      kLauncher, launch_args(2, pid_recording_worker(dir),
                             concat({"--epochs", "50", "--batch-size", "16", "--log-every", "2", "--metrics", metrics},
                                    extra)));
  const bool training = mtrain::testing::wait_until(
      [&] {
        std::ifstream in(metrics);
        std::string text((std::istreambuf_iterator<char>(in)), {});
        return text.find("\"event\":\"step\"") != std::string::npos && std::filesystem::exists(dir.file("pid.1"));
      },
      std::chrono::seconds(60));
  REQUIRE(training);
  g.rank0 = read_pid(dir.file("pid.0"));
  g.rank1 = read_pid(dir.file("pid.1"));
  return g;
}

}  // namespace

// Note [Root cause] in launcher/failure_report.cpp: a launcher that reaps late sees the
// surviving peer's "connection closed/reset by peer" error stamped before the killed
// rank's exit; the killed rank must still be named, with its status.
TEST_CASE("a launcher held up around a worker's SIGKILL still names the killed rank and exit 137", "[multiproc]") {
  for (int run = 0; run < 10; ++run) {
    INFO("run " << run);
    TempDir dir;
    TrainingGang g = start_training_gang(dir, {});
    g.launcher->signal(SIGSTOP);
    REQUIRE(::kill(g.rank1, SIGKILL) == 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    g.launcher->signal(SIGCONT);
    const ProcessResult r = g.launcher->wait();
    INFO("stderr:\n" << r.err);
    CHECK(r.exit_code == 137);
    CHECK_THAT(r.err, Contains("rank       : 1 (local_rank 1, node 0)"));
    CHECK_THAT(r.err, Contains("signal 9 (SIGKILL)"));
  }
}

TEST_CASE("a hung (SIGSTOPped) rank ends the job within --timeout and a few seconds, and is named", "[multiproc]") {
  TempDir dir;
  TrainingGang g = start_training_gang(dir, {"--timeout", "5"});
  REQUIRE(::kill(g.rank1, SIGSTOP) == 0);
  const auto stopped = std::chrono::steady_clock::now();
  const ProcessResult r = g.launcher->wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  INFO("stderr:\n" << r.err);
  CHECK(r.exit_code != 0);
  CHECK(seconds < 8);  // --timeout 5; the teardown used to wait --term_timeout for the stopped rank
  // Stopped before its all-reduce, rank 1 never reached it; stopped inside it, it is found
  // stopped by the teardown. Either way the report names it, not rank 0.
  CHECK_THAT(r.err, Contains("rank       : 1 (never reached the collective that timed out; reported by rank 0)") ||
                        Contains("rank       : 1 (found stopped (SIGSTOP) inside the collective that timed out; "
                                 "reported by rank 0)"));
  CHECK_THAT(r.err, Contains("of which were found stopped (SIGSTOP) and got SIGKILL: rank 1\n"));
}

TEST_CASE("a corrupt latest checkpoint resumes from the previous one, with a warning", "[multiproc]") {
  // Note [The previous checkpoint] in trainer/checkpoint/checkpointer.cpp.
  TempDir dir;
  const auto ckpt = dir.file("ckpt");
  const auto latest = ckpt + "/checkpoint.safetensors", previous = ckpt + "/checkpoint.previous.safetensors";
  require_exit(train({"--batch-size", "32", "--max-steps", "6", "--checkpoint-every", "2", "--checkpoint-dir", ckpt}),
               0);
  REQUIRE(std::filesystem::exists(previous));
  const int64_t previous_step = checkpoint_total_steps(previous);
  CHECK(previous_step < checkpoint_total_steps(latest));
  {
    std::fstream f(latest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  const std::string damaged_bytes = read_file(latest);
  const auto resumed =
      train({"--batch-size", "32", "--max-steps", "8", "--checkpoint-dir", ckpt, "--log-level", "info"});
  require_exit(resumed, 0);
  CHECK_THAT(resumed.out + resumed.err, Contains("checksum mismatch") && Contains("resuming the previous checkpoint " +
                                                                                    previous));
  CHECK_THAT(resumed.out, Contains(fmt::format("resuming from {}: ", previous)) &&
                              Contains(fmt::format("{} steps in total", previous_step)));
  CHECK(checkpoint_total_steps(latest) == 8);
  // The damaged file was set aside, not rotated into the previous slot by the save at step 8:
  // the previous checkpoint is still the good one it resumed from.
  CHECK(read_file(ckpt + "/checkpoint.damaged.safetensors") == damaged_bytes);
  CHECK(checkpoint_total_steps(previous) == previous_step);
  CHECK_FALSE(std::filesystem::exists(ckpt + "/checkpoint.incoming.safetensors"));

  // Both damaged: the error names both, and the launcher spends no restart on it.
  for (const auto& path : {latest, previous}) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  const auto r = mtrain::testing::run_process(
      kLauncher, concat({"--nproc_per_node=1", "--max_restarts=3", "train"},
                        train_args({"--batch-size", "32", "--max-steps", "10", "--checkpoint-dir", ckpt})));
  INFO("stderr:\n" << r.err);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("the previous checkpoint cannot be resumed either"));
  CHECK_THAT(r.err, Contains("FAILED (attempt 0, 3 restart(s) left, not used: the root cause says it would repeat)"));
  CHECK_THAT(r.err, !Contains("restarting the gang"));
}

TEST_CASE("a rank killed during start-up: the peers the launcher stops are named in the report", "[multiproc]") {
  // Rank 1 dies of SIGKILL before it joins; rank 0, waiting for it at the rendezvous, ends
  // on the teardown's SIGTERM with a start-up stop record, which is the launcher's doing.
  TempDir dir;
  const std::string wrapper = dir.file("worker.sh");
  {
    std::ofstream out(wrapper);
    out << "#!/bin/sh\nif [ \"$RANK\" = 1 ]; then sleep 1; kill -9 $$; fi\nexec " << kTrainer << " \"$@\"\n";
  }
  std::filesystem::permissions(wrapper, std::filesystem::perms::owner_all);
  const ProcessResult r = mtrain::testing::run_process(kLauncher, launch_args(2, wrapper, {"--max-steps", "5"}));
  INFO("stderr:\n" << r.err);
  CHECK(r.exit_code == 137);
  CHECK_THAT(r.err, Contains("rank       : 1 (local_rank 1, node 0)"));
  CHECK_THAT(r.err, Contains("Stopped by the launcher after the root cause: rank 0"));
}
