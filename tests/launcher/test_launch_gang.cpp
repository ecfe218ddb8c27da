// mtrain-launch end to end on one host: environment, multi-node on loopback (static and
// dynamic), failure teardown, restarts, signals, logs. Each test starts real launchers
// running tests/launcher/launch_test_worker.
#include <catch2/catch.hpp>

#include <sched.h>
#include <sys/resource.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <set>

#include "tests/launcher/launch_harness.h"

using namespace mtrain::testing;

namespace {

std::string W() { return worker_path(); }

// After a launcher exited normally: every recorded process is gone and reaped (the
// launcher reaps its workers, and their children through PR_SET_CHILD_SUBREAPER).
void require_all_reaped(const std::vector<pid_t>& pids) {
  REQUIRE_FALSE(pids.empty());
  for (pid_t p : pids) {
    INFO("pid " << p << (process_alive(p) ? " survived" : " is an unreaped zombie"));
    CHECK_FALSE(process_exists(p));
  }
}

// After the launcher was SIGKILLed nobody reaps for it, so dead (or a zombie waiting for
// init) is all that can be asked; allow the sentinel a moment to act.
void require_all_dead(const std::vector<pid_t>& pids) {
  REQUIRE_FALSE(pids.empty());
  wait_until(
      [&] {
        for (pid_t p : pids) {
          if (process_alive(p)) return false;
        }
        return true;
      },
      3.0);
  for (pid_t p : pids) {
    INFO("pid " << p << " survived");
    CHECK_FALSE(process_alive(p));
  }
}

}  // namespace

TEST_CASE("four workers get ranks 0..3 once each and torchrun's environment") {
  TempDir dir;
  const std::string logs = (dir.path() / "logs").string();
  const auto r = run_launcher({"--nproc_per_node=4", "--rdzv-id", "envjob", "--role", "trainer",
                               "--log_dir", logs, W(), "record=" + dir.str(), "barrier"},
                              dir.path());
  INFO(r.err);
  REQUIRE_FALSE(r.timed_out);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("OMP_NUM_THREADS is not set; setting it to 1"));

  const auto records = read_records(dir.path());
  REQUIRE(records.size() == 4);
  std::set<std::string> ports, tokens;
  for (int rank = 0; rank < 4; ++rank) {
    REQUIRE(records.count(rank) == 1);
    const Record& e = records.at(rank);
    CHECK(e.at("RANK") == std::to_string(rank));
    CHECK(e.at("LOCAL_RANK") == std::to_string(rank));
    CHECK(e.at("WORLD_SIZE") == "4");
    CHECK(e.at("LOCAL_WORLD_SIZE") == "4");
    CHECK(e.at("GROUP_RANK") == "0");
    CHECK(e.at("GROUP_WORLD_SIZE") == "1");
    CHECK(e.at("ROLE_NAME") == "trainer");
    CHECK(e.at("ROLE_RANK") == std::to_string(rank));
    CHECK(e.at("ROLE_WORLD_SIZE") == "4");
    CHECK(e.at("MASTER_ADDR") == "127.0.0.1");
    CHECK(std::stoi(e.at("MASTER_PORT")) > 0);
    // MASTER_* is for the workers' own framework, the launchers' store is elsewhere.
    CHECK(e.at("MTRAIN_STORE_ADDR") == "127.0.0.1");
    CHECK(std::stoi(e.at("MTRAIN_STORE_PORT")) > 0);
    CHECK(e.at("MTRAIN_STORE_PORT") != e.at("MASTER_PORT"));
    CHECK(e.at("TORCHELASTIC_USE_AGENT_STORE") == "False");
    CHECK(e.at("NCCL_ASYNC_ERROR_HANDLING") == "1");
    CHECK(e.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
    CHECK(e.at("MTRAIN_RESTART_COUNT") == "0");
    CHECK(e.at("MTRAIN_MAX_RESTARTS") == "0");
    CHECK(e.at("MTRAIN_RUN_ID") == "envjob");
    CHECK(e.at("MTRAIN_ERROR_FILE") ==
          (fs::path(logs) / "attempt_0" / std::to_string(rank) / "error.json").string());
    CHECK(e.at("MTRAIN_STORE_TOKEN").size() >= 32);
    CHECK(e.at("MTRAIN_STORE_PREFIX") == "job/envjob/attempt_0");
    CHECK(e.at("TORCHELASTIC_RESTART_COUNT") == "0");
    CHECK(e.at("TORCHELASTIC_MAX_RESTARTS") == "0");
    CHECK(e.at("TORCHELASTIC_RUN_ID") == "envjob");
    CHECK(e.at("TORCHELASTIC_ERROR_FILE") == e.at("MTRAIN_ERROR_FILE"));
    CHECK(e.at("OMP_NUM_THREADS") == "1");
    ports.insert(e.at("MASTER_PORT"));
    tokens.insert(e.at("MTRAIN_STORE_TOKEN"));
  }
  CHECK(ports.size() == 1);
  CHECK(tokens.size() == 1);
}

TEST_CASE("a user's OMP_NUM_THREADS and MTRAIN_STORE_TOKEN are passed through") {
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node", "2", W(), "record=" + dir.str(), "barrier"},
                              dir.path(), 30, {"OMP_NUM_THREADS=3", "MTRAIN_STORE_TOKEN=sekrit"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, !Catch::Contains("OMP_NUM_THREADS"));
  const auto records = read_records(dir.path());
  REQUIRE(records.size() == 2);
  for (const auto& [rank, e] : records) {
    CHECK(e.at("OMP_NUM_THREADS") == "3");
    CHECK(e.at("MTRAIN_STORE_TOKEN") == "sekrit");
  }
}

TEST_CASE("two static nodes on loopback with different nproc form one world") {
  TempDir dir;
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> env{"MTRAIN_STORE_TOKEN=twonodes"};
  const std::vector<std::string> common{"--nnodes=2", "--master_addr=127.0.0.1",
                                        "--master_port=" + port, "--rdzv_id=static2"};
  auto args = [&](int node, int nproc) {
    std::vector<std::string> a = common;
    a.push_back("--node_rank=" + std::to_string(node));
    a.push_back("--nproc_per_node=" + std::to_string(nproc));
    a.insert(a.end(), {W(), "record=" + dir.str(), "barrier"});
    return a;
  };
  // Node 1 first: it must wait for node 0's store instead of failing.
  LauncherProcess node1(args(1, 1), dir.path(), env, "node1");
  LauncherProcess node0(args(0, 2), dir.path(), env, "node0");
  const auto r0 = node0.wait(30);
  const auto r1 = node1.wait(30);
  INFO(r0.err << r1.err);
  REQUIRE(r0.exit_code == 0);
  REQUIRE(r1.exit_code == 0);
  const auto records = read_records(dir.path());
  REQUIRE(records.size() == 3);
  for (int rank = 0; rank < 3; ++rank) {
    const Record& e = records.at(rank);
    CHECK(e.at("WORLD_SIZE") == "3");
    CHECK(e.at("GROUP_WORLD_SIZE") == "2");
    CHECK(e.at("GROUP_RANK") == (rank < 2 ? "0" : "1"));
    CHECK(e.at("LOCAL_RANK") == (rank < 2 ? std::to_string(rank) : "0"));
    CHECK(e.at("LOCAL_WORLD_SIZE") == (rank < 2 ? "2" : "1"));
    CHECK(e.at("MTRAIN_STORE_PORT") == port);
    CHECK(e.at("MTRAIN_STORE_TOKEN") == "twonodes");
    // Node 0's free port for the workers' own framework, the same on every node.
    CHECK(e.at("MASTER_PORT") != port);
    CHECK(e.at("MASTER_PORT") == records.at(0).at("MASTER_PORT"));
  }
}

TEST_CASE("dynamic rendezvous assigns node ranks in join order") {
  TempDir dir;
  const std::string endpoint = "127.0.0.1:" + std::to_string(free_port());
  const std::vector<std::string> env{"MTRAIN_STORE_TOKEN=dyn"};
  const fs::path a_dir = dir.path() / "a", b_dir = dir.path() / "b";
  fs::create_directories(a_dir);
  fs::create_directories(b_dir);
  auto args = [&](int nproc, const fs::path& records) {
    return std::vector<std::string>{"--rdzv_endpoint", endpoint, "--rdzv_id", "dynjob",
                                    "--nnodes", "2:3", "--rdzv_last_call", "0.5",
                                    "--nproc_per_node", std::to_string(nproc), W(),
                                    "record=" + records.string(), "barrier"};
  };
  // a joins first (it takes milliseconds; the round cannot close before b joins, since
  // MIN is 2), so a is node 0 with ranks 0 and 1, and b node 1 with rank 2.
  LauncherProcess a(args(2, a_dir), dir.path(), env, "a");
  std::this_thread::sleep_for(std::chrono::seconds(1));
  LauncherProcess b(args(1, b_dir), dir.path(), env, "b");
  const auto ra = a.wait(30);
  const auto rb = b.wait(30);
  INFO(ra.err << rb.err);
  REQUIRE(ra.exit_code == 0);
  REQUIRE(rb.exit_code == 0);
  const auto a_records = read_records(a_dir);
  const auto b_records = read_records(b_dir);
  REQUIRE(a_records.size() == 2);
  REQUIRE(b_records.size() == 1);
  std::set<std::string> a_ranks;
  for (const auto& [rank, e] : a_records) {
    CHECK(e.at("GROUP_RANK") == "0");
    CHECK(e.at("WORLD_SIZE") == "3");
    CHECK(e.at("GROUP_WORLD_SIZE") == "2");
    a_ranks.insert(e.at("RANK"));
  }
  CHECK(a_ranks == std::set<std::string>{"0", "1"});
  for (const auto& [rank, e] : b_records) {
    CHECK(e.at("GROUP_RANK") == "1");
    CHECK(e.at("RANK") == "2");
    CHECK(e.at("LOCAL_RANK") == "0");
  }
}

TEST_CASE("a worker killed with SIGKILL stops the whole gang, children included") {
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node=3", W(), "record=" + dir.str(),
                               "spawn-child=" + dir.str(), "rank1:sleep=0.3", "rank1:signal=9",
                               "sleep=30"},
                              dir.path(), 20);
  INFO(r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 128 + 9);
  CHECK(r.seconds < 3.0);
  CHECK_THAT(r.err, Catch::Contains("rank       : 1 (local_rank 1, node 0)"));
  CHECK_THAT(r.err, Catch::Contains("signal 9 (SIGKILL)"));
  CHECK_THAT(r.err, Catch::Contains("OOM killer"));
  CHECK_THAT(r.err, Catch::Contains("Stopped by the launcher after the root cause: ranks 0, 2"));
  REQUIRE(recorded_pids(dir.path()).size() == 6);
  require_all_reaped(recorded_pids(dir.path()));
}

TEST_CASE("a worker that ignores SIGTERM is SIGKILLed after --term_timeout") {
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node=2", "--term_timeout=1", W(),
                               "record=" + dir.str(), "ignore-term", "rank0:sleep=0.2",
                               "rank0:exit=5", "sleep=30"},
                              dir.path(), 20);
  INFO(r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 5);
  CHECK(r.seconds >= 1.1);
  CHECK(r.seconds < 4.0);
  CHECK_THAT(r.err, Catch::Contains("exit code 5"));
  CHECK_THAT(r.err, Catch::Contains("ignored SIGTERM for --term_timeout 1 s and got SIGKILL: rank 1"));
  require_all_reaped(recorded_pids(dir.path()));
}

TEST_CASE("SIGKILL to the launcher takes its workers and their children with it") {
  TempDir dir;
  LauncherProcess launcher({"--nproc_per_node=2", W(), "record=" + dir.str(),
                            "spawn-child=" + dir.str(), "sleep=30"},
                           dir.path());
  REQUIRE(wait_until([&] { return count_files_with_prefix(dir.path(), "child_") == 2 &&
                                  count_files_with_prefix(dir.path(), "rank") == 2; },
                     10));
  const auto pids = recorded_pids(dir.path());
  REQUIRE(pids.size() == 4);
  for (pid_t p : pids) REQUIRE(process_alive(p));
  ::kill(launcher.pid(), SIGKILL);
  const auto r = launcher.wait(5);
  CHECK(r.signaled);
  require_all_dead(pids);
}

namespace {

// Two static nodes on loopback with one worker each, recording into n0/ and n1/ under
// `dir`. `flags` go to both launchers, `worker0`/`worker1` to each worker after record=.
struct TwoNodes {
  std::string node0_dir, node1_dir;
  std::unique_ptr<LauncherProcess> node0, node1;
};

TwoNodes start_two_nodes(const TempDir& dir, const std::string& token, const std::vector<std::string>& flags,
                         const std::vector<std::string>& worker0, const std::vector<std::string>& worker1) {
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> env{"MTRAIN_STORE_TOKEN=" + token};
  TwoNodes nodes{(dir.path() / "n0").string(), (dir.path() / "n1").string(), nullptr, nullptr};
  const auto start = [&](int rank, const std::string& records, const std::vector<std::string>& worker) {
    fs::create_directories(records);
    std::vector<std::string> args{"--nnodes=2", "--node_rank=" + std::to_string(rank), "--master_port=" + port,
                                  "--nproc_per_node=1"};
    args.insert(args.end(), flags.begin(), flags.end());
    args.insert(args.end(), {W(), "record=" + records});
    args.insert(args.end(), worker.begin(), worker.end());
    return std::make_unique<LauncherProcess>(args, dir.path(), env, "node" + std::to_string(rank));
  };
  nodes.node0 = start(0, nodes.node0_dir, worker0);
  nodes.node1 = start(1, nodes.node1_dir, worker1);
  return nodes;
}

// Once both nodes' workers run, SIGKILLs node `victim`'s launcher (its workers die with
// it), and returns how the other node's launcher ended and how many seconds after the kill.
std::pair<LaunchResult, double> kill_one_node(TwoNodes& nodes, int victim) {
  REQUIRE(wait_until(
      [&] { return read_records(nodes.node0_dir).size() == 1 && read_records(nodes.node1_dir).size() == 1; }, 20));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  LauncherProcess& killed = victim == 0 ? *nodes.node0 : *nodes.node1;
  LauncherProcess& survivor = victim == 0 ? *nodes.node1 : *nodes.node0;
  const auto killed_at = std::chrono::steady_clock::now();
  ::kill(killed.pid(), SIGKILL);
  killed.wait(10);
  const LaunchResult r = survivor.wait(30);
  return {r, std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count()};
}

}  // namespace

TEST_CASE("a failure on node 1 brings down node 0's workers within seconds") {
  TempDir dir;
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> env{"MTRAIN_STORE_TOKEN=teardown"};
  const std::string node0_dir = (dir.path() / "n0").string();
  fs::create_directories(node0_dir);
  LauncherProcess node0({"--nnodes=2", "--node_rank=0", "--master_port=" + port,
                         "--nproc_per_node=2", W(), "record=" + node0_dir,
                         "spawn-child=" + node0_dir, "sleep=30"},
                        dir.path(), env, "node0");
  LauncherProcess node1({"--nnodes=2", "--node_rank=1", "--master_port=" + port,
                         "--nproc_per_node=1", W(), "sleep=0.5", "error=boom on node one",
                         "exit=3"},
                        dir.path(), env, "node1");
  const auto r1 = node1.wait(20);
  const auto r0 = node0.wait(20);
  INFO("node0: " << r0.err << "\nnode1: " << r1.err);
  REQUIRE_FALSE(r0.timed_out);
  CHECK(r1.exit_code == 3);
  CHECK(r0.exit_code == 3);
  CHECK(r0.seconds < 5.0);
  CHECK_THAT(r0.err, Catch::Contains("reported by another node"));
  CHECK_THAT(r0.err, Catch::Contains("boom on node one"));
  CHECK_THAT(r1.err, Catch::Contains("rank       : 2 (local_rank 0, node 1)"));
  require_all_reaped(recorded_pids(node0_dir));
}

TEST_CASE("an error file that is not UTF-8 still reaches the other node") {
  // A record cut in the middle of a character (a worker killed while writing it): its
  // excerpt in the report holds bytes nlohmann's strict dump would throw on, which used
  // to take node 1's launcher down before it published or printed anything.
  TempDir dir;
  auto nodes = start_two_nodes(dir, "utf8", {}, {"sleep=30"}, {"sleep=0.5", "error=caf\xc3 \xff broke", "exit=3"});
  auto& node0 = *nodes.node0;
  auto& node1 = *nodes.node1;
  const auto r1 = node1.wait(20);
  const auto r0 = node0.wait(20);
  INFO("node0: " << r0.err << "\nnode1: " << r1.err);
  CHECK(r1.exit_code == 3);
  CHECK(r0.exit_code == 3);
  CHECK_THAT(r1.err, Catch::Contains("error file is not valid JSON"));
  CHECK_THAT(r0.err, Catch::Contains("reported by another node"));
  CHECK_THAT(r0.err, Catch::Contains("broke"));
}

TEST_CASE("--max_restarts restarts the gang with an incremented restart count") {
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node=2", "--max_restarts=2", W(),
                               "record=" + dir.str(), "rank1:sleep=0.3", "rank1:fail-attempts=0,1",
                               "barrier"},
                              dir.path(), 30);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Catch::Contains("attempt 0 failed"));
  CHECK_THAT(r.err, Catch::Contains("attempt 1 failed"));
  CHECK_THAT(r.err, Catch::Contains("failing on purpose on attempt 1"));
  for (int attempt = 0; attempt < 3; ++attempt) {
    const auto records = read_records(dir.path(), attempt);
    REQUIRE(records.size() == 2);
    for (const auto& [rank, e] : records) {
      CHECK(e.at("MTRAIN_RESTART_COUNT") == std::to_string(attempt));
      CHECK(e.at("TORCHELASTIC_RESTART_COUNT") == std::to_string(attempt));
      CHECK(e.at("MTRAIN_MAX_RESTARTS") == "2");
      CHECK(e.at("MTRAIN_STORE_PREFIX").find("attempt_" + std::to_string(attempt)) !=
            std::string::npos);
    }
  }
}

TEST_CASE("restarts run out: the last failure is reported") {
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node=1", "--max_restarts=1", W(),
                               "fail-attempts=0,1"},
                              dir.path(), 30);
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("FAILED (attempt 1, no restarts left)"));
  CHECK_THAT(r.err, Catch::Contains("failing on purpose on attempt 1"));
}

TEST_CASE("the root cause is the earliest failure by error-file time, with its message") {
  TempDir dir;
  // Rank 1 records its error first but exits last; rank 0 exits first without a record.
  const auto r = run_launcher({"--nproc_per_node=2", "--term_timeout=5", W(),
                               "rank1:error=the real problem", "rank1:ignore-term",
                               "rank1:sleep=0.8", "rank1:exit=7", "rank0:sleep=0.3",
                               "rank0:exit=5"},
                              dir.path(), 20);
  INFO(r.err);
  CHECK(r.exit_code == 7);
  CHECK_THAT(r.err, Catch::Contains("rank       : 1 (local_rank 1, node 0)"));
  CHECK_THAT(r.err, Catch::Contains("message    : the real problem"));
  CHECK_THAT(r.err, Catch::Contains("(from its error file)"));
  CHECK_THAT(r.err, Catch::Contains("rank 0 (local_rank 0, node 0): exit code 5"));
}

TEST_CASE("--log_dir, --redirects, --tee and --local_ranks_filter route worker output") {
  TempDir dir;
  const fs::path logs = dir.path() / "logs";
  const std::vector<std::string> worker{W(), "say=hello-out", "say-err=hello-err"};

  SECTION("tee both streams: files plus prefixed console lines") {
    auto args = std::vector<std::string>{"--nproc_per_node=2", "--log_dir", logs.string(),
                                         "--tee", "3"};
    args.insert(args.end(), worker.begin(), worker.end());
    const auto r = run_launcher(args, dir.path());
    REQUIRE(r.exit_code == 0);
    for (int rank = 0; rank < 2; ++rank) {
      const fs::path rd = logs / "attempt_0" / std::to_string(rank);
      CHECK(read_text(rd / "stdout.log") == "hello-out\n");
      CHECK(read_text(rd / "stderr.log") == "hello-err\n");
      CHECK_THAT(r.out, Catch::Contains("[rank" + std::to_string(rank) + "]:hello-out\n"));
      CHECK_THAT(r.err, Catch::Contains("[rank" + std::to_string(rank) + "]:hello-err\n"));
    }
  }
  SECTION("redirect only: files, nothing on the console") {
    auto args = std::vector<std::string>{"--nproc-per-node=2", "--log-dir", logs.string(),
                                         "--redirects", "0:1,1:3"};
    args.insert(args.end(), worker.begin(), worker.end());
    const auto r = run_launcher(args, dir.path());
    REQUIRE(r.exit_code == 0);
    CHECK(read_text(logs / "attempt_0/0/stdout.log") == "hello-out\n");
    CHECK(read_text(logs / "attempt_0/1/stderr.log") == "hello-err\n");
    CHECK_FALSE(fs::exists(logs / "attempt_0/0/stderr.log"));
    CHECK(r.out.empty());
    CHECK_THAT(r.err, Catch::Contains("hello-err"));  // rank 0's stderr is not redirected
  }
  SECTION("local_ranks_filter hides other ranks from the console, not from the files") {
    auto args = std::vector<std::string>{"--nproc_per_node=2", "--log_dir", logs.string(),
                                         "--tee", "1", "--local_ranks_filter", "1"};
    args.insert(args.end(), worker.begin(), worker.end());
    const auto r = run_launcher(args, dir.path());
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.out, Catch::Contains("[rank1]:hello-out"));
    CHECK_THAT(r.out, !Catch::Contains("[rank0]"));
    CHECK(read_text(logs / "attempt_0/0/stdout.log") == "hello-out\n");
  }
}

TEST_CASE("SIGUSR1 to the launcher is forwarded and supervision goes on") {
  TempDir dir;
  LauncherProcess launcher({"--nproc_per_node=2", W(), "wait-usr1=" + dir.str()}, dir.path());
  REQUIRE(wait_until([&] { return count_files_with_prefix(dir.path(), "ready_") == 2; }, 10));
  ::kill(launcher.pid(), SIGUSR1);
  const auto r = launcher.wait(20);
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(count_files_with_prefix(dir.path(), "usr1_rank") == 2);
}

TEST_CASE("SIGTERM to the launcher stops every worker and exits 128+15") {
  TempDir dir;
  LauncherProcess launcher({"--nproc_per_node=2", W(), "record=" + dir.str(),
                            "spawn-child=" + dir.str(), "sleep=30"},
                           dir.path());
  REQUIRE(wait_until([&] { return count_files_with_prefix(dir.path(), "child_") == 2; }, 10));
  ::kill(launcher.pid(), SIGTERM);
  const auto r = launcher.wait(10);
  INFO(r.err);
  CHECK(r.exit_code == 128 + 15);
  CHECK(r.seconds < 10);
  CHECK_THAT(r.err, Catch::Contains("received SIGTERM"));
  require_all_reaped(recorded_pids(dir.path()));
}

TEST_CASE("workers read end-of-file from standard input, not the launcher's terminal") {
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node=2", W(), "read-stdin=" + dir.str()}, dir.path());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  REQUIRE(count_files_with_prefix(dir.path(), "stdin_") == 2);
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    if (entry.path().filename().string().rfind("stdin_", 0) != 0) continue;
    std::ifstream in(entry.path());
    size_t bytes = 99;
    in >> bytes;
    CHECK(bytes == 0);
  }
}

TEST_CASE("SIGTERM during a failure's teardown ends the job: no restart, exit 128+15") {
  // Rank 1 fails; rank 0 ignores the SIGTERM that follows, so the teardown lasts until
  // --term_timeout. A SIGTERM to the launcher meanwhile must end the job, not let
  // --max_restarts start another attempt.
  TempDir dir;
  LauncherProcess launcher({"--nproc_per_node=2", "--max_restarts=3", "--term_timeout=5", W(),
                            "record=" + dir.str(), "rank0:ignore-term", "rank0:sleep=30", "rank1:sleep=0.2",
                            "rank1:stamp=" + dir.str(), "rank1:exit=3"},
                           dir.path());
  REQUIRE(wait_until([&] { return count_files_with_prefix(dir.path(), "stamp_rank1") == 1; }, 10));
  // Rank 1 exits right after its stamp; the teardown then lasts --term_timeout (5 s).
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  ::kill(launcher.pid(), SIGTERM);
  const auto r = launcher.wait(20);
  INFO(r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 128 + 15);
  CHECK_THAT(r.err, Catch::Contains("received SIGTERM while stopping the workers"));
  CHECK_THAT(r.err, Catch::Contains("no restart: SIGTERM arrived while the workers were being stopped"));
  CHECK_THAT(r.err, Catch::Contains("exit code 3"));
  CHECK(read_records(dir.path(), 1).empty());  // no second attempt
  require_all_reaped(recorded_pids(dir.path()));
}

TEST_CASE("two workers that fail in the same monitor pass are both failures, not one stopped by the other") {
  // The launcher is held stopped while both workers end, so one pass of its loop reaps
  // both; rank 0 comes first in that pass.
  TempDir dir;
  LauncherProcess launcher({"--nproc_per_node=2", W(), "record=" + dir.str(), "sleep=2", "rank0:exit=5",
                            "rank1:signal=11"},
                           dir.path());
  REQUIRE(wait_until([&] { return read_records(dir.path()).size() == 2; }, 10));
  ::kill(launcher.pid(), SIGSTOP);  // well inside the workers' 2 s sleep
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));
  ::kill(launcher.pid(), SIGCONT);
  const auto r = launcher.wait(20);
  INFO(r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK_THAT(r.err, Catch::Contains("exit code 5"));
  CHECK_THAT(r.err, Catch::Contains("SIGSEGV"));
  CHECK_THAT(r.err, !Catch::Contains("Stopped by the launcher after the root cause"));
}


TEST_CASE("a node whose launcher dies without a word is found by its missing heartbeats") {
  // Note [Agent heartbeats]. Node 1's launcher is SIGKILLed: it announces nothing and its
  // workers die with it. Node 0 must stop within about --heartbeat_timeout, both while
  // its own workers run and after they all succeeded.
  for (const bool node0_done : {false, true}) {
    DYNAMIC_SECTION((node0_done ? "node 0's workers have succeeded" : "node 0's workers are running")) {
      TempDir dir;
      auto nodes = start_two_nodes(dir, "heartbeat", {"--heartbeat_timeout=2"},
                                   {node0_done ? "exit=0" : "sleep=30"}, {"sleep=30"});
      const auto [r0, after_kill] = kill_one_node(nodes, 1);
      INFO("node0: " << r0.err);
      REQUIRE_FALSE(r0.timed_out);
      CHECK(r0.exit_code != 0);
      CHECK(after_kill < 12.0);
      CHECK_THAT(r0.err, Catch::Contains("the launcher on node 1 stopped responding: no heartbeat for"));
      require_all_reaped(recorded_pids(nodes.node0_dir));
      require_all_dead(recorded_pids(nodes.node1_dir));
    }
  }
}

TEST_CASE("a node that loses the store's host stops its workers and says so") {
  // The reverse of the heartbeat case: node 0 hosts the store and is SIGKILLed. Node 1's
  // next store request fails (the connection resets), so it must stop its workers and
  // exit non-zero, naming the store, well before its own workers would have finished.
  TempDir dir;
  auto nodes = start_two_nodes(dir, "storelost", {"--heartbeat_timeout=2"}, {"sleep=30"}, {"sleep=30"});
  const auto [r1, after_kill] = kill_one_node(nodes, 0);
  INFO("node1: " << r1.err);
  REQUIRE_FALSE(r1.timed_out);
  CHECK(r1.exit_code != 0);
  CHECK(after_kill < 12.0);
  CHECK_THAT(r1.err, Catch::Contains("lost the rendezvous store at 127.0.0.1:"));
  require_all_reaped(recorded_pids(nodes.node1_dir));
}

TEST_CASE("a failure on one node restarts every node's gang") {
  // --max_restarts across nodes: node 1's worker fails in attempt 0 only; both nodes
  // start attempt 1, which succeeds everywhere.
  TempDir dir;
  auto nodes = start_two_nodes(dir, "restarts", {"--max_restarts=1"}, {"sleep=1"}, {"fail-attempts=0"});
  auto& node0 = *nodes.node0;
  auto& node1 = *nodes.node1;
  const std::string& node0_dir = nodes.node0_dir;
  const std::string& node1_dir = nodes.node1_dir;
  const auto r1 = node1.wait(40);
  const auto r0 = node0.wait(40);
  INFO("node0: " << r0.err << "\nnode1: " << r1.err);
  CHECK(r0.exit_code == 0);
  CHECK(r1.exit_code == 0);
  // (Node 0's attempt-0 worker may be stopped before it writes its record.)
  CHECK(read_records(node1_dir, 0).size() == 1);
  for (const auto& node_dir : {node0_dir, node1_dir}) {
    INFO(node_dir);
    const auto second = read_records(node_dir, 1);
    REQUIRE(second.size() == 1);
    CHECK(second.begin()->second.at("MTRAIN_RESTART_COUNT") == "1");
  }
}

namespace {

// mtrain-launch started with this thread's CPU affinity narrowed to `cpus` (the launcher
// inherits it, like `taskset -c`); the test's own affinity is restored at once.
LaunchResult run_launcher_on_cpus(const std::vector<int>& cpus, const std::vector<std::string>& args,
                                  const fs::path& dir) {
  cpu_set_t original;
  REQUIRE(sched_getaffinity(0, sizeof original, &original) == 0);
  cpu_set_t narrow;
  CPU_ZERO(&narrow);
  for (int cpu : cpus) CPU_SET(cpu, &narrow);
  REQUIRE(sched_setaffinity(0, sizeof narrow, &narrow) == 0);
  std::optional<LauncherProcess> p;
  try {
    p.emplace(args, dir);
  } catch (...) {
    sched_setaffinity(0, sizeof original, &original);
    throw;
  }
  REQUIRE(sched_setaffinity(0, sizeof original, &original) == 0);
  return p->wait(30);
}

std::vector<int> usable_cpu_numbers() {
  cpu_set_t set;
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

}  // namespace

TEST_CASE("cpu_bind cores gives each worker and its children their own CPUs") {
  const std::vector<int> usable = usable_cpu_numbers();
  if (usable.size() < 2) {
    WARN("skipped: needs two usable CPUs, found " << usable.size());
    return;
  }
  const std::vector<int> two{usable[0], usable[1]};
  TempDir dir;
  // grep is the worker's child: what it reads from /proc is the inherited affinity.
  const std::string report = "grep Cpus_allowed_list /proc/self/status | cut -f2 > " + dir.str() +
                             "/cpus.$LOCAL_RANK; echo $OMP_NUM_THREADS > " + dir.str() +
                             "/omp.$LOCAL_RANK";
  const auto first_line = [&](const std::string& name) {
    std::string line;
    std::ifstream in(dir.path() / name);
    std::getline(in, line);
    return line;
  };

  SECTION("two workers on two CPUs: one CPU and one thread each") {
    const auto r = run_launcher_on_cpus(
        two, {"--nproc_per_node=2", "--cpu_bind=cores", "/bin/sh", "-c", report}, dir.path());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.err, Catch::Contains("binding workers to CPUs"));
    const std::set<std::string> got{first_line("cpus.0"), first_line("cpus.1")};
    CHECK(got == std::set<std::string>{std::to_string(two[0]), std::to_string(two[1])});
    CHECK(first_line("omp.0") == "1");
    CHECK(first_line("omp.1") == "1");
  }
  SECTION("one worker on two CPUs: both, and two threads") {
    const auto r = run_launcher_on_cpus(
        two, {"--nproc_per_node=1", "--cpu_bind=cores", "/bin/sh", "-c", report}, dir.path());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const std::string both = std::to_string(two[0]) + (two[1] == two[0] + 1 ? "-" : ",") +
                             std::to_string(two[1]);
    CHECK(first_line("cpus.0") == both);
    CHECK(first_line("omp.0") == "2");
  }
  SECTION("two workers on one CPU: refused before anything starts") {
    const auto r = run_launcher_on_cpus(
        {usable[0]}, {"--nproc_per_node=2", "--cpu_bind=cores", "/bin/sh", "-c", report},
        dir.path());
    INFO(r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Catch::Contains("--cpu_bind cores: expected at least one CPU per local "
                                      "worker, found 2 workers and 1 usable CPU(s)"));
    CHECK_FALSE(fs::exists(dir.path() / "cpus.0"));
  }
}

TEST_CASE("workers inherit an open-file limit raised towards the hard limit") {
  // The store and Gloo need a file per connection (raise_open_file_limit in main.cpp).
  rlimit files{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &files) == 0);
  const rlim_t expected = files.rlim_cur >= 65536 ? files.rlim_cur : std::min<rlim_t>(65536, files.rlim_max);
  TempDir dir;
  const std::string out = (dir.path() / "limit").string();
  const auto r = run_launcher({"--nproc_per_node=1", "/bin/sh", "-c", "ulimit -n > " + out}, dir.path());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  std::ifstream in(out);
  std::string limit;
  in >> limit;
  CHECK(limit == (expected == RLIM_INFINITY ? std::string("unlimited") : std::to_string(expected)));
}

TEST_CASE("nodes started with different --max_restarts or --nnodes are refused at rendezvous") {
  TempDir dir;
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> env{"MTRAIN_STORE_TOKEN=settings"};
  LauncherProcess node0({"--nnodes=2", "--node_rank=0", "--master_port=" + port, "--max_restarts=1",
                         "--nproc_per_node=1", W(), "sleep=30"},
                        dir.path(), env, "node0");
  LauncherProcess node1({"--nnodes=2", "--node_rank=1", "--master_port=" + port, "--nproc_per_node=1", W(),
                         "sleep=30"},
                        dir.path(), env, "node1");
  const auto r1 = node1.wait(20);
  const auto r0 = node0.wait(20);
  INFO("node0: " << r0.err << "\nnode1: " << r1.err);
  REQUIRE_FALSE(r0.timed_out);
  REQUIRE_FALSE(r1.timed_out);
  CHECK(r0.exit_code == 2);
  CHECK(r1.exit_code == 2);
  CHECK(r0.seconds < 10);
  CHECK_THAT(r0.err, Catch::Contains("node 1 of job 'none' was started with --nnodes 2:2, --max_restarts 0, "
                                     "this node (node 0) with --nnodes 2:2, --max_restarts 1"));
  CHECK_THAT(r1.err, Catch::Contains("every node needs the same --nnodes and --max_restarts"));
}

TEST_CASE("a rank that exited 0 before the failure is named in the report") {
  // Its peers often fail because of it (a collective that never completes).
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node=2", W(), "rank0:exit=0", "rank1:sleep=0.5", "rank1:exit=3"},
                              dir.path(), 20);
  INFO(r.err);
  CHECK(r.exit_code == 3);
  CHECK_THAT(r.err, Catch::Contains("Exited with status 0 before the failure, while their peers ran on: rank 0"));
}
