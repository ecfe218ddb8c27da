// Network partitions between two hosts (tests/multihost/netns_pair.h): namespace B's link is
// taken down mid-run for longer than --heartbeat_timeout, then brought back. Node A hosts the
// rendezvous store, so a cut is, for B, the store's host cut off, and for A, a silent node.
// - With --nnodes 1:2, A goes on alone and the job ends with the weights one process trains
//   on the same global batches; B ends while the link is still down, naming the lost store,
//   and never acts as a second job on the shared checkpoint directory.
// - With a static --nnodes 2 neither can go on: both end within the trainer's --timeout of the
//   cut, B naming the lost store and A the silent node.
// - A cut shorter than --heartbeat_timeout under --nnodes 1:2 still ends in one job's weights,
//   and B rejoins or ends naming the lost store, never as a clean stop.
// (Note [A lost store is not asked again] in launcher/attempt.cpp.)
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/multihost/multihost_agents.h"
#include "tests/multihost/netns_pair.h"
#include "tests/trainer/background_process.h"
#include "tests/trainer/elastic_run.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"

using Catch::Matchers::Contains;
using mtrain::testing::BackgroundProcess;
using mtrain::testing::NetnsPair;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;
using mtrain::testing::concat;

namespace {

using Clock = std::chrono::steady_clock;

// The trainer's collective timeout, and the bound on how long after the cut an agent that
// cannot go on may take to end. Detection takes --heartbeat_timeout (3 s), the teardown
// --term_timeout (3 s).
constexpr int kTrainerTimeoutSeconds = 12;
// Longer than that bound, so every agent that must end does so while the link is down.
constexpr std::chrono::milliseconds kLongCut{(kTrainerTimeoutSeconds + 5) * 1000};
// Shorter than --heartbeat_timeout: the link is back while requests across it still wait.
constexpr std::chrono::milliseconds kShortCut{2500};

std::vector<std::string> launcher_flags(const std::vector<std::string>& rendezvous, const TempDir& dir) {
  return concat(concat(rendezvous, {"--nproc_per_node", "1", "--max_restarts", "1", "--term_timeout", "3",
                                    "--monitor_interval", "0.2", "--heartbeat_timeout", "3", "train", "--timeout",
                                    std::to_string(kTrainerTimeoutSeconds)}),
                mtrain::testing::elastic_training(dir));
}

std::unique_ptr<BackgroundProcess> start_agent(const NetnsPair& net, const std::string& ns,
                                               const std::vector<std::string>& launcher_args) {
  return std::make_unique<BackgroundProcess>(
      net.ip_tool(), concat({"netns", "exec", ns, mtrain::testing::kTimeoutTool},
                            mtrain::testing::agent_command(launcher_args)));
}

// How two agents fared around a cut of B's link.
struct CutOutcome {
  ProcessResult a, b;
  std::optional<double> a_ended_s, b_ended_s;  // after the cut, when they ended during it
};

// Starts A, then B, cuts B's link once the job has written its first checkpoint, and
// brings it back after `length` (or once both agents have ended).
CutOutcome cut_b_mid_run(const NetnsPair& net, const std::vector<std::string>& a_args,
                         const std::vector<std::string>& b_args, const TempDir& dir,
                         std::chrono::milliseconds length) {
  auto a = start_agent(net, net.ns_a(), a_args);
  // A first, so that it hosts the store and joins first (rank 0).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto b = start_agent(net, net.ns_b(), b_args);
  REQUIRE(mtrain::testing::wait_until([&] { return mtrain::testing::elastic_checkpoint_written(dir); },
                                      std::chrono::seconds(60)));
  REQUIRE(a->running());
  REQUIRE(b->running());
  net.set_link_b(false);
  const auto cut = Clock::now();
  CutOutcome out;
  const auto since_cut = [&] { return std::chrono::duration<double>(Clock::now() - cut).count(); };
  while (Clock::now() - cut < length && (!out.a_ended_s || !out.b_ended_s)) {
    if (!out.a_ended_s && !a->running()) out.a_ended_s = since_cut();
    if (!out.b_ended_s && !b->running()) out.b_ended_s = since_cut();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  net.set_link_b(true);
  out.a = a->wait();
  out.b = b->wait();
  return out;
}

std::string describe(const CutOutcome& o) {
  const auto when = [](const std::optional<double>& s) {
    return s ? fmt::format("{:.1f} s after the cut", *s) : std::string("after the link came back");
  };
  return fmt::format("A: exit {} {}\nstderr:\n{}\nB: exit {} {}\nstderr:\n{}", o.a.exit_code, when(o.a_ended_s),
                     o.a.err, o.b.exit_code, when(o.b_ended_s), o.b.err);
}

const std::string kStoreLost = fmt::format("lost the rendezvous store at {}", NetnsPair::kAddressA);

std::vector<std::string> elastic_flags(const TempDir& dir) {
  return launcher_flags({"--rdzv_endpoint", fmt::format("{}:29400", NetnsPair::kAddressA), "--rdzv_id", "partition",
                         "--nnodes", "1:2", "--rdzv_last_call", "1"},
                        dir);
}

}  // namespace

TEST_CASE("a node cut off under --nnodes 1:2: the other finishes the job alone, the cut-off one ends naming the store",
          "[multiproc][multihost]") {
  const auto net = mtrain::testing::netns_pair_or_skip();
  mtrain::testing::prepare_agent_environment();
  TempDir dir;
  const auto args = elastic_flags(dir);
  const CutOutcome o = cut_b_mid_run(*net, args, args, dir, kLongCut);
  INFO(describe(o));
  REQUIRE(o.a.exit_code == 0);
  CHECK_THAT(o.a.err, Contains("stopped responding: no heartbeat for"));
  CHECK_THAT(o.a.err, Contains("the job now runs on 1 node(s) instead of 2"));
  // B ends by itself, before the link is back, and says why it did not restart.
  REQUIRE(o.b_ended_s.has_value());
  CHECK(*o.b_ended_s < kTrainerTimeoutSeconds);
  CHECK(o.b.exit_code == 1);
  CHECK_THAT(o.b.err, Contains(kStoreLost));
  CHECK_THAT(o.b.err, Contains("not used: a lost store ends the job"));
  // Had B trained on as a second job, the checkpoints and the epochs would show it.
  mtrain::testing::check_elastic_training(dir);
}

TEST_CASE("the store's host cut off from a static two-node job: both nodes end within --timeout, each naming why",
          "[multiproc][multihost]") {
  const auto net = mtrain::testing::netns_pair_or_skip();
  mtrain::testing::prepare_agent_environment();
  TempDir dir;
  const std::vector<std::string> rendezvous = {"--nnodes", "2", "--master_addr", NetnsPair::kAddressA,
                                               "--master_port", "29500", "--rdzv_id", "partition-static"};
  const CutOutcome o = cut_b_mid_run(*net, launcher_flags(concat(rendezvous, {"--node_rank", "0"}), dir),
                                     launcher_flags(concat(rendezvous, {"--node_rank", "1"}), dir), dir, kLongCut);
  INFO(describe(o));
  REQUIRE(o.a_ended_s.has_value());
  REQUIRE(o.b_ended_s.has_value());
  CHECK(*o.a_ended_s < kTrainerTimeoutSeconds);
  CHECK(*o.b_ended_s < kTrainerTimeoutSeconds);
  CHECK(o.a.exit_code == 1);
  CHECK(o.b.exit_code == 1);
  CHECK_THAT(o.a.err, Contains("the launcher on node 1 stopped responding: no heartbeat for"));
  CHECK_THAT(o.a.err, Contains("not used: fewer nodes remain than --nnodes needs"));
  CHECK_THAT(o.b.err, Contains(kStoreLost));
}

TEST_CASE("a cut shorter than --heartbeat_timeout under --nnodes 1:2: the job finishes, the cut-off node never "
          "passes for stopped",
          "[multiproc][multihost]") {
  // The link is back while B's store request still waits: B's worker and A's may then agree
  // to stop after a step on B's teardown signal. B must not take that for a user's stop
  // (exit 75, "resume by running again"): it rejoins, or ends naming the lost store.
  const auto net = mtrain::testing::netns_pair_or_skip();
  mtrain::testing::prepare_agent_environment();
  TempDir dir;
  const auto args = elastic_flags(dir);
  const CutOutcome o = cut_b_mid_run(*net, args, args, dir, kShortCut);
  INFO(describe(o));
  REQUIRE(o.a.exit_code == 0);
  CHECK_THAT(o.b.err, !Contains("STOPPED on a signal"));
  if (o.b.exit_code != 0) {
    CHECK(o.b.exit_code == 1);
    CHECK_THAT(o.b.err, Contains(kStoreLost));
  }
  mtrain::testing::check_elastic_training(dir);
}
