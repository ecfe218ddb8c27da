// Bad input to mtrain-launch: each is one clear line on stderr and a non-zero exit, and
// nothing is left running.
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include "tests/launcher/launch_harness.h"

using namespace mtrain::testing;

namespace {

// The launcher's own error line (run_main's format), not a report or a worker's output.
void check_one_line_error(const LaunchResult& r, const std::string& must_contain) {
  INFO("stderr: " << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code != 0);
  CHECK(r.err.rfind("mtrain-launch: error: ", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_THAT(r.err, Catch::Contains(must_contain));
}

}  // namespace

TEST_CASE("bad --nproc_per_node values are rejected") {
  TempDir dir;
  for (const char* bad : {"0", "abc", "-1", "2x"}) {
    INFO("--nproc_per_node " << bad);
    const auto r = run_launcher({"--nproc_per_node", bad, "true"}, dir.path(), 10);
    check_one_line_error(r, "--nproc_per_node");
    CHECK(r.exit_code == 2);
  }
}

TEST_CASE("--node_rank must be below --nnodes") {
  TempDir dir;
  const auto r = run_launcher({"--nnodes=2", "--node_rank=2", "--master_port=29999", "true"},
                              dir.path(), 10, {"MTRAIN_STORE_TOKEN=t"});
  check_one_line_error(r, "--node_rank: expected a rank in [0, 2)");
}

TEST_CASE("several nodes need MTRAIN_STORE_TOKEN and a fixed port") {
  TempDir dir;
  check_one_line_error(
      run_launcher({"--nnodes=2", "--node_rank=0", "--master_port=29999", "true"}, dir.path(), 10),
      "MTRAIN_STORE_TOKEN is not set");
  check_one_line_error(run_launcher({"--nnodes=2", "--master_port=0", "true"}, dir.path(), 10,
                                    {"MTRAIN_STORE_TOKEN=t"}),
                       "--master_port 0");
}

TEST_CASE("a port already in use is named, with the --master_port 0 advice") {
  TempDir dir;
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(s, 4) == 0);
  socklen_t len = sizeof(a);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string port = std::to_string(ntohs(a.sin_port));
  const auto r = run_launcher({"--master_port", port, "true"}, dir.path(), 10);
  ::close(s);
  check_one_line_error(r, "port " + port);
  CHECK_THAT(r.err, Catch::Contains("--master_port 0"));
}

TEST_CASE("an unreachable master fails after --rdzv_timeout, naming the address") {
  TempDir dir;
  const std::string port = std::to_string(free_port());
  const auto r = run_launcher({"--nnodes=2", "--node_rank=1", "--master_port", port,
                               "--rdzv_timeout=1", "true"},
                              dir.path(), 15, {"MTRAIN_STORE_TOKEN=t"});
  check_one_line_error(r, "127.0.0.1:" + port);
  CHECK(r.seconds >= 0.9);
  CHECK(r.seconds < 8);
}

TEST_CASE("--rdzv_conf is_host and --local_addr do what they say, or say why not") {
  TempDir dir;
  const std::string endpoint = "--rdzv_endpoint=127.0.0.1:" + std::to_string(free_port());
  // is_host=false never hosts: with nobody else hosting, the join times out.
  const auto joiner = run_launcher({endpoint, "--rdzv_conf=is_host=false,join_timeout=1", "true"}, dir.path(), 15);
  check_one_line_error(joiner, "could not join the rendezvous store");
  // Without it the same launcher hosts the endpoint itself and runs.
  CHECK(run_launcher({endpoint, "--rdzv_conf=join_timeout=1", "true"}, dir.path(), 15).exit_code == 0);
  // is_host=true must host: an endpoint that is not this machine's is its bind error.
  check_one_line_error(run_launcher({"--rdzv_endpoint=192.0.2.1:29400", "--rdzv_conf=is_host=true", "true"},
                                    dir.path(), 15),
                       "192.0.2.1");
  check_one_line_error(run_launcher({"--local_addr=192.0.2.1", "true"}, dir.path(), 15),
                       "--local_addr 192.0.2.1: expected an address of this node");
}

TEST_CASE("a missing or non-executable program is a clear error") {
  TempDir dir;
  check_one_line_error(run_launcher({"/nonexistent/prog"}, dir.path(), 10), "does not exist");
  check_one_line_error(run_launcher({"no-such-program-mtrain"}, dir.path(), 10), "was not found");
  const fs::path script = dir.path() / "not_executable.sh";
  std::ofstream(script) << "#!/bin/sh\nexit 0\n";
  ::chmod(script.c_str(), 0644);
  check_one_line_error(run_launcher({script.string()}, dir.path(), 10), "not an executable");
  check_one_line_error(run_launcher({"--nproc_per_node=2"}, dir.path(), 10),
                       "expected a program to run");
  check_one_line_error(run_launcher({"--bogus-flag", "true"}, dir.path(), 10),
                       "unknown option '--bogus-flag'");
}

TEST_CASE("a node with the wrong token is refused; the other node times out") {
  TempDir dir;
  const std::string port = std::to_string(free_port());
  LauncherProcess node0({"--nnodes=2", "--node_rank=0", "--master_port", port,
                         "--rdzv_timeout=2", worker_path(), "sleep=30"},
                        dir.path(), {"MTRAIN_STORE_TOKEN=right"}, "node0");
  LauncherProcess node1({"--nnodes=2", "--node_rank=1", "--master_port", port,
                         "--rdzv_timeout=2", worker_path(), "sleep=30"},
                        dir.path(), {"MTRAIN_STORE_TOKEN=wrong"}, "node1");
  const auto r1 = node1.wait(15);
  const auto r0 = node0.wait(15);
  check_one_line_error(r1, "rejected the job token");
  // The hosting node says why it never saw node 1, then gives up.
  INFO("node0 stderr: " << r0.err);
  CHECK(r0.exit_code != 0);
  CHECK_THAT(r0.err, Catch::Contains("wrong job token"));
  CHECK_THAT(r0.err, Catch::EndsWith("node rank(s) 1 of 2 never joined\n"));
}
