// Elastic membership end to end (Note [Joining a running job] in launcher/rendezvous.cpp,
// Note [Resuming in another world] in trainer/loop/train_loop.cpp): launchers as nodes on
// loopback with a dynamic rendezvous and --nnodes MIN:MAX, real mtrain-train workers over
// Gloo. A node lost mid-run leaves the job to the others; a node that arrives mid-run
// joins it; either way the weights are those one process trains on the same global
// batches, and every epoch trains on each of its images once.
#include <signal.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <functional>
#include <memory>
#include <thread>

#include "tests/support/held_port.h"
#include "tests/trainer/background_process.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/elastic_run.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"

using Catch::Matchers::Contains;
using mtrain::testing::BackgroundProcess;
using mtrain::testing::HeldPort;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;
using mtrain::testing::check_elastic_training;
using mtrain::testing::elastic_checkpoint_written;
using mtrain::testing::elastic_training;
using mtrain::testing::require_exit_0;
using mtrain::testing::concat;
using mtrain::testing::kLauncher;

namespace {

// One node's launcher: one worker, a dynamic rendezvous at `endpoint`, heartbeats missed
// for 3 s taken as a lost node.
std::unique_ptr<BackgroundProcess> start_node(const std::string& endpoint, const std::string& nnodes,
                                              int max_restarts, const TempDir& dir) {
  return std::make_unique<BackgroundProcess>(
      kLauncher, concat({"--rdzv_endpoint", endpoint, "--rdzv_id", "elastic", "--nnodes", nnodes, "--nproc_per_node",
                         "1", "--max_restarts", std::to_string(max_restarts), "--rdzv_last_call", "1",
                         "--term_timeout", "3", "--monitor_interval", "0.2", "--heartbeat_timeout", "3", "train"},
                        elastic_training(dir)));
}

// Three nodes with MIN 2, so losing one leaves enough: a (the first, hosting the store), b
// and c. `lose_c` does to c's launcher what the test is about once the run has written
// its first checkpoint; a and b must then finish the job without it, and a's log say
// `a_says`.
void lose_third_node(const std::function<void(BackgroundProcess&)>& lose_c, const std::string& a_says) {
  TempDir dir;
  HeldPort port;
  port.release();
  const std::string endpoint = fmt::format("127.0.0.1:{}", port.port());
  auto a = start_node(endpoint, "2:3", 1, dir);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto b = start_node(endpoint, "2:3", 1, dir);
  auto c = start_node(endpoint, "2:3", 1, dir);
  REQUIRE(mtrain::testing::wait_until([&] { return elastic_checkpoint_written(dir); }, std::chrono::seconds(60)));
  REQUIRE(c->running());
  lose_c(*c);
  const ProcessResult ra = a->wait();
  const ProcessResult rb = b->wait();
  if (c->running()) c->signal(SIGKILL);  // a frozen one; its worker goes with it (PR_SET_PDEATHSIG)
  c->wait();
  require_exit_0(ra, "node a");
  require_exit_0(rb, "node b");
  CHECK_THAT(ra.err, Contains(a_says));
  CHECK_THAT(ra.err, Contains("the job now runs on 2 node(s) instead of 3"));
  // Rank 0 logs it, on whichever node joined the new round first.
  CHECK_THAT(ra.err + ra.out + rb.err + rb.out, Contains("world 3 -> 2: the checkpoint's 3 rank(s) took"));
  check_elastic_training(dir);
}

}  // namespace

TEST_CASE("3 nodes, one launcher killed mid-run: the other 2 finish the job, as one process trains it",
          "[multiproc][elastic]") {
  // Its workers die with it, and the others' collectives fail at once.
  lose_third_node([](BackgroundProcess& c) { c.signal(SIGKILL); }, "restarting the gang (1 of 1 restarts)");
}

TEST_CASE("3 nodes, one launcher frozen: its missing heartbeats restart the other 2 without it",
          "[multiproc][elastic]") {
  // SIGSTOP: the frozen launcher announces nothing and its worker trains on, so no worker
  // fails; only the store's host, missing the node's heartbeats, can find it lost.
  lose_third_node([](BackgroundProcess& c) { c.signal(SIGSTOP); }, "stopped responding: no heartbeat for");
}

TEST_CASE("a node that arrives mid-run joins the job: no restart spent, the same training", "[multiproc][elastic]") {
  TempDir dir;
  HeldPort port;
  port.release();
  const std::string endpoint = fmt::format("127.0.0.1:{}", port.port());
  // --max_restarts 0: a re-form that spent a restart would end the job.
  auto a = start_node(endpoint, "1:2", 0, dir);
  REQUIRE(mtrain::testing::wait_until([&] { return elastic_checkpoint_written(dir); }, std::chrono::seconds(60)));
  REQUIRE(a->running());
  auto b = start_node(endpoint, "1:2", 0, dir);
  const ProcessResult rb = b->wait();
  const ProcessResult ra = a->wait();
  require_exit_0(ra, "node a");
  require_exit_0(rb, "node b");
  CHECK_THAT(rb.err, Contains("closed with 1 node(s) before this node joined; waiting for them to re-form the job"));
  CHECK_THAT(ra.err, Contains("1 node(s) waiting to join; re-forming the job with 2 nodes (no restart spent)"));
  CHECK_THAT(ra.err, Contains("the job now runs on 2 node(s) instead of 1"));
  CHECK_THAT(ra.err + ra.out + rb.err + rb.out, Contains("world 1 -> 2: the checkpoint's 1 rank(s) took"));
  check_elastic_training(dir);
}
