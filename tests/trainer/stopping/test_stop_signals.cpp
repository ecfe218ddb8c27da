// The worker's stop machinery in-process: which signal does what (Note [Stopping on a
// signal]), how the ranks' votes combine, the largest winning (Note [Stop votes]),
// that a real signal reaches the flag the training loop reads, that it never runs on a
// thread inside a oneDNN kernel (Note [Signals never interrupt kernels]), and the
// start-up exit's armed and disarmed states, in child processes (Note [A stop signal
// during start-up]), and that clearing the acknowledgement waits for one in progress.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/main_guard.h"
#include "tensor/ops.h"
#include "tests/support/scoped_env.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "trainer/stopping/error_file.h"
#include "trainer/ddp/step_exchange.h"
#include "trainer/stopping/stop_signals.h"

using mtrain::StopSignalAction;

namespace {

constexpr int64_t kSecond = 1'000'000'000;

// The stop signals are taken by their own thread, so a process-directed signal is
// recorded shortly after kill() returns, not before.
bool wait_for_pending(int sig) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (mtrain::pending_stop_signal() != sig) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

}  // namespace

TEST_CASE("the first stop signal asks for a stop; a second SIGTERM or SIGINT means now") {
  using mtrain::classify_stop_signal;
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) {
    CHECK(classify_stop_signal(0, 0, sig, 5 * kSecond) == StopSignalAction::kRequestStop);
  }
  // Two seconds later: a deliberate second signal.
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGTERM, 3 * kSecond) == StopSignalAction::kExitImmediately);
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGINT, 3 * kSecond) == StopSignalAction::kExitImmediately);
  CHECK(classify_stop_signal(SIGUSR1, kSecond, SIGTERM, 3 * kSecond) == StopSignalAction::kExitImmediately);
  // SIGUSR1 is a warning: repeating it never forces an exit.
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGUSR1, 30 * kSecond) == StopSignalAction::kIgnoreRepeat);
  CHECK(classify_stop_signal(SIGUSR1, kSecond, SIGUSR1, 30 * kSecond) == StopSignalAction::kIgnoreRepeat);
  // The same SIGTERM delivered by slurmstepd and by the launcher, a few ms apart.
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGTERM, kSecond + 5'000'000) == StopSignalAction::kIgnoreRepeat);
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGTERM, kSecond + mtrain::kDuplicateSignalWindowNs) ==
        StopSignalAction::kExitImmediately);
  // The same two copies handled on two threads at once: the second handler runs between
  // the first one's publishing the signal and its storing the time.
  CHECK(classify_stop_signal(SIGTERM, 0, SIGTERM, 5 * kSecond) == StopSignalAction::kIgnoreRepeat);
  CHECK(classify_stop_signal(SIGTERM, 0, SIGINT, 5 * kSecond) == StopSignalAction::kIgnoreRepeat);
}

TEST_CASE("the maximum of the ranks' votes names the highest signal and the lowest rank that got it") {
  using mtrain::decode_stop_vote;
  using mtrain::encode_stop_vote;
  CHECK(encode_stop_vote(0, 3) == 0);
  CHECK(decode_stop_vote(0).signal == 0);
  for (int rank : {0, 1, 7, 4095, 1 << 30}) {
    const auto v = decode_stop_vote(encode_stop_vote(SIGUSR1, rank));
    CHECK(v.signal == SIGUSR1);
    CHECK(v.rank == rank);
  }
  // What the largest vote is over ranks 0..3 when ranks 1 and 3 got SIGTERM and
  // rank 2 SIGUSR1.
  const std::vector<int64_t> votes = {encode_stop_vote(0, 0), encode_stop_vote(SIGTERM, 1),
                                      encode_stop_vote(SIGUSR1, 2), encode_stop_vote(SIGTERM, 3)};
  const auto agreed = decode_stop_vote(*std::max_element(votes.begin(), votes.end()));
  CHECK(agreed.signal == SIGTERM);
  CHECK(agreed.rank == 1);
  CHECK(mtrain::stop_signal_name(SIGTERM) == "SIGTERM");
  CHECK(mtrain::stop_signal_name(SIGUSR1) == "SIGUSR1");
}

TEST_CASE("a real signal sets the pending stop, and a world of one agrees with itself") {
  mtrain::install_stop_signal_handlers();
  mtrain::clear_pending_stop_signal();
  REQUIRE(mtrain::pending_stop_signal() == 0);
  REQUIRE(::kill(::getpid(), SIGUSR1) == 0);  // the default action would end this test binary
  CHECK(wait_for_pending(SIGUSR1));
  REQUIRE(::kill(::getpid(), SIGUSR1) == 0);  // a repeat changes nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(mtrain::pending_stop_signal() == SIGUSR1);

  // A world of one's step exchange agrees with its own vote.
  mtrain::StepExchange local(nullptr, mtrain::Device::cpu());
  local.issue({mtrain::encode_stop_vote(mtrain::pending_stop_signal(), 0)}, {8, true}, -1);
  local.finish();
  CHECK(mtrain::decode_stop_vote(local.agreed_stop_vote()).signal == SIGUSR1);
  mtrain::clear_pending_stop_signal();
  CHECK(mtrain::pending_stop_signal() == 0);
}

TEST_CASE("stop signals never interrupt a thread inside oneDNN's sgemm") {
  // This thread runs the linear layer's sgemm (oneDNN's JIT kernels point rsp into the
  // heap while they run) while another floods the process with SIGUSR1. With the signal
  // handled on this thread, the signal frames overwrote heap memory and the process
  // aborted within a second (Note [Signals never interrupt kernels]). Every product is
  // checked against its known value too.
  mtrain::install_stop_signal_handlers();
  mtrain::clear_pending_stop_signal();
  mtrain::ops::set_num_threads(1);
  const int64_t batch = 32, in = 784, out = 256;  // an MLP layer on a batch of 32
  const mtrain::Tensor x = mtrain::Tensor::full({batch, in}, 1.0f);
  const mtrain::Tensor w = mtrain::Tensor::full({out, in}, 0.5f);   // as the layer holds it
  const mtrain::Tensor wt = mtrain::Tensor::full({in, out}, 0.5f);  // and transposed
  mtrain::Tensor y = mtrain::Tensor::empty({batch, out});

  std::atomic<bool> done{false};
  std::atomic<long> sent{0};
  std::thread sender([&] {
    while (!done.load()) {
      if (::kill(::getpid(), SIGUSR1) == 0) ++sent;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  long wrong = 0;
  // At least 1.5 s and 1000 signals: on a loaded machine the sender thread gets fewer
  // turns, so the count, not the clock, decides (within a generous cap).
  const auto start = std::chrono::steady_clock::now();
  const auto enough = [&] {
    const auto elapsed = std::chrono::steady_clock::now() - start;
    return (elapsed >= std::chrono::milliseconds(1500) && sent.load() > 1000) || elapsed >= std::chrono::seconds(30);
  };
  long products = 0;
  while (!enough()) {
    for (const bool transposed : {true, false}) {
      mtrain::ops::matmul(x, false, transposed ? w : wt, transposed, y);
      const float* p = y.data<float>();
      for (int64_t i = 0; i < batch * out; ++i) wrong += p[i] != 0.5f * static_cast<float>(in);
      ++products;
    }
  }
  done = true;
  sender.join();
  INFO(sent.load() << " signals during " << products << " products");
  CHECK(sent.load() > 1000);
  CHECK(wrong == 0);
  CHECK(wait_for_pending(SIGUSR1));
  mtrain::clear_pending_stop_signal();
}

TEST_CASE("the error record is whole JSON even for a message that is not UTF-8", "[unit]") {
  // A Latin-1 path in a message made nlohmann's strict dump throw after the file had
  // been truncated: the launcher then read an empty record, and a clean stop (whose
  // record says "stopped") was reported as a failure.
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("mtrain-error-record-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::filesystem::path file = dir / "error.json";
  {
    mtrain::testing::ScopedEnv record("MTRAIN_ERROR_FILE", file.string());
    mtrain::write_error_record("cannot open /data/caf\xe9.bin", {{"stopped", true}});
  }
  std::ifstream in(file);
  const auto j = nlohmann::json::parse(in);  // throws (and fails) on an empty or broken file
  CHECK(j.at("message").get<std::string>() == "cannot open /data/caf\xEF\xBF\xBD.bin");
  CHECK(j.at("stopped") == true);
  // Written beside the record and renamed: nothing else is left in the directory.
  CHECK(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()) == 1);
  std::filesystem::remove_all(dir);
}

// Note [A stop signal during start-up]: the arm/disarm state machine, each case in a
// child process (the start-up exit ends the process it runs in). The children are the
// hidden cases below, run by name from this same binary; each writes what its start-up
// action saw to the file MTRAIN_TEST_STARTUP_MARKER names.
namespace {

constexpr const char* kMarkerVariable = "MTRAIN_TEST_STARTUP_MARKER";

// Whether this process was started by run_startup_child: the hidden cases do nothing
// otherwise (run by hand, or selected by a wildcard, the first would end the suite).
bool in_startup_child() { return std::getenv(kMarkerVariable) != nullptr; }

void write_marker(const std::string& text) { std::ofstream(std::getenv(kMarkerVariable)) << text; }

// What a hidden case of this binary did, run in a child process.
struct ChildOutcome {
  int exit_code = -1;
  std::string marker;  // what its start-up action (or the case itself) wrote
  std::string output;  // its stdout and stderr, for the failure messages
};

ChildOutcome run_startup_child(const std::string& name) {
  mtrain::testing::TempDir dir;
  const std::string marker = dir.file("marker");
  mtrain::testing::ScopedEnv env(kMarkerVariable, marker);
  const auto result = mtrain::testing::run_process(std::filesystem::read_symlink("/proc/self/exe").string(), {name});
  return {result.exit_code, mtrain::testing::slurp(marker), name + ":\n" + result.out + result.err};
}

}  // namespace

TEST_CASE("startup child: armed then a stop signal", "[.startup-child]") {
  if (!in_startup_child()) return;
  mtrain::install_stop_signal_handlers();
  mtrain::arm_startup_stop([](int sig) { write_marker("action " + mtrain::stop_signal_name(sig)); });
  ::kill(::getpid(), SIGTERM);
  std::this_thread::sleep_for(std::chrono::seconds(10));  // the signal thread ends the process first
}

TEST_CASE("startup child: a stop signal before arming", "[.startup-child]") {
  if (!in_startup_child()) return;
  mtrain::install_stop_signal_handlers();
  ::kill(::getpid(), SIGINT);
  if (!wait_for_pending(SIGINT)) return;
  // The signal thread records the signal, then finds the exit not armed; arming then
  // takes the exit on this thread. Were the signal thread that slow, it would take it
  // itself, which the Note allows too: either way the process ends with the action.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  mtrain::arm_startup_stop([](int sig) { write_marker("action " + mtrain::stop_signal_name(sig)); });
  std::this_thread::sleep_for(std::chrono::seconds(10));
}

TEST_CASE("startup child: disarmed then a stop signal", "[.startup-child]") {
  if (!in_startup_child()) return;
  mtrain::install_stop_signal_handlers();
  mtrain::arm_startup_stop([](int) { write_marker("action"); });
  mtrain::disarm_startup_stop();
  mtrain::disarm_startup_stop();  // idempotent
  ::kill(::getpid(), SIGTERM);
  REQUIRE(wait_for_pending(SIGTERM));  // recorded for the first step boundary instead
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  write_marker("still running, pending " + mtrain::stop_signal_name(mtrain::pending_stop_signal()));
}

TEST_CASE("startup child: an action that throws", "[.startup-child]") {
  if (!in_startup_child()) return;
  mtrain::install_stop_signal_handlers();
  mtrain::arm_startup_stop([](int) {
    write_marker("thrown");
    throw std::runtime_error("the stop record could not be written");
  });
  ::kill(::getpid(), SIGTERM);
  std::this_thread::sleep_for(std::chrono::seconds(10));
}

std::atomic<bool> g_acknowledging{false}, g_acknowledged{false};

TEST_CASE("startup child: an acknowledgement cleared while it runs", "[.startup-child]") {
  if (!in_startup_child()) return;
  mtrain::install_stop_signal_handlers();
  mtrain::set_stop_acknowledgement([](int) {
    g_acknowledging.store(true);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    g_acknowledged.store(true);
  });
  ::kill(::getpid(), SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!g_acknowledging.load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // Note [An acknowledgement never outlives the run]: what follows clearing may be the exit.
  mtrain::set_stop_acknowledgement(nullptr);
  write_marker(g_acknowledged.load() ? "cleared after it finished" : "cleared while it ran");
}

TEST_CASE("the start-up exit: armed it exits 75 after its action, disarmed it leaves the signal to the step; "
          "clearing an acknowledgement waits for it",
          "[unit]") {
  using Catch::Matchers::Equals;
  struct Expected {
    const char* child;
    int exit_code;
    const char* marker;
  };
  for (const Expected& e : {Expected{"startup child: armed then a stop signal", mtrain::kStoppedExitCode, "action SIGTERM"},
                            Expected{"startup child: a stop signal before arming", mtrain::kStoppedExitCode, "action SIGINT"},
                            Expected{"startup child: disarmed then a stop signal", 0, "still running, pending SIGTERM"},
                            Expected{"startup child: an action that throws", mtrain::kStoppedExitCode, "thrown"},
                            Expected{"startup child: an acknowledgement cleared while it runs", 0,
                                     "cleared after it finished"}}) {
    const ChildOutcome outcome = run_startup_child(e.child);
    INFO(outcome.output);
    CHECK(outcome.exit_code == e.exit_code);
    CHECK_THAT(outcome.marker, Equals(e.marker));
  }
}
