// Training across two hosts: one mtrain-launch agent in each of two network namespaces
// (tests/multihost/netns_pair.h), one worker each, node 0's store on 198.51.100.1. The
// weights they save must be those of the same training on one host with two workers,
// for the static rendezvous (--master_addr) and the dynamic one (--rdzv_endpoint).
//
// Note [Multi-host equivalence]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Both runs are a world of two ranks with the same flags: rank r reads the same shard,
// both start from rank 0's broadcast weights, and Gloo picks its all-reduce by world
// size and message size, not by where the peers are. The veth carries the bytes the
// loopback would have carried, and a sum of two floats does not depend on the order
// of its operands, so the weights must be bit-identical: the tolerance is zero. (If a
// future all-reduce split the work by host, three or more ranks could round
// differently; two cannot.) OMP_NUM_THREADS and --threads are pinned to 1 so no kernel
// picks a different blocking in one of the runs.
//
// Equality alone would also hold if each agent had trained a world of one by itself
// (each writes the same rank-0 file), so the test also checks that such a run gives
// different weights, that the store listened on 198.51.100.1 only, and that the
// gradients crossed the veth (its byte counters).
#include <arpa/inet.h>
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <stdlib.h>

#include <chrono>
#include <future>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "tests/multihost/multihost_agents.h"
#include "tests/multihost/netns_pair.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "tests/trainer/weights_compare.h"
#include "trainer/checkpoint/safetensors.h"

using Catch::Matchers::Contains;
using mtrain::testing::NetnsPair;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;
using mtrain::testing::kLauncher;
using mtrain::testing::kMiniSet;
using mtrain::testing::concat;
using mtrain::testing::netns_pair_or_skip;
using mtrain::testing::prepare_agent_environment;
using mtrain::testing::run_agent;

namespace {

constexpr int kMaxSteps = 10;

std::vector<std::string> training_flags(const std::string& save_final) {
  return {"train",
          "--model", "mlp",
          "--max-steps", std::to_string(kMaxSteps),
          "--batch-size", "16",
          "--lr", "0.1",
          "--no-eval",
          "--threads", "1",
          "--data-dir", kMiniSet,
          "--timeout", "60",
          "--check-replicas", "5",
          "--save-final", save_final};
}

void require_success(const std::string& who, const ProcessResult& r) {
  INFO(who << " exit " << r.exit_code << "\nstdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
}

// A TCP socket in LISTEN state, from /proc/net/tcp{,6} of the namespace that reads it.
struct Listener {
  std::string file;     // "tcp" or "tcp6"
  std::string address;  // as the kernel prints it: hex of the raw (network order) address
  int port = 0;
};

std::vector<Listener> listeners(const NetnsPair& net, const std::string& ns) {
  std::vector<Listener> found;
  for (const std::string file : {"tcp", "tcp6"}) {
    const auto r = net.run_in(ns, "/bin/cat", {"/proc/net/" + file});
    if (r.exit_code != 0) throw std::runtime_error("cannot read /proc/net/" + file + " in " + ns + ": " + r.err);
    std::istringstream lines(r.out);
    std::string line;
    std::getline(lines, line);  // header
    while (std::getline(lines, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const size_t colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A = TCP_LISTEN
      found.push_back({file, local.substr(0, colon), std::stoi(local.substr(colon + 1), nullptr, 16)});
    }
  }
  return found;
}

// An IPv4 address as /proc/net/tcp prints it (the __be32 printed as a native %08X).
std::string proc_net_ipv4(const char* dotted) {
  in_addr a{};
  REQUIRE(::inet_pton(AF_INET, dotted, &a) == 1);
  return fmt::format("{:08X}", a.s_addr);
}

// Starts node 0's agent in namespace A and returns once its store listens on `port`
// (node 0 then waits for node 1, so the listener can be inspected before node 1
// starts). Checks that the store listens on 198.51.100.1 alone: not on a wildcard
// address, not on loopback.
std::future<ProcessResult> start_node0_and_check_listener(const NetnsPair& net, const std::vector<std::string>& args,
                                                          int port) {
  auto node0 = std::async(std::launch::async, [&net, args] { return run_agent(net, net.ns_a(), args); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::vector<Listener> on_port;
  while (on_port.empty()) {
    if (node0.wait_for(std::chrono::milliseconds(0)) == std::future_status::ready) {
      const auto r = node0.get();
      FAIL("node 0's agent ended before its store listened (exit " << r.exit_code << "):\n" << r.err);
    }
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    for (const auto& l : listeners(net, net.ns_a())) {
      if (l.port == port) on_port.push_back(l);
    }
    if (on_port.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(on_port.size() == 1);
  CHECK(on_port[0].file == "tcp");
  CHECK(on_port[0].address == proc_net_ipv4(NetnsPair::kAddressA));
  return node0;
}

// Bytes received by a veth end, from the kernel's counters in its namespace.
int64_t received_bytes(const NetnsPair& net, const std::string& ns, const std::string& dev) {
  const auto r = net.ip_command({"-j", "-s", "-n", ns, "link", "show", "dev", dev});
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  return j.at(0).at("stats64").at("rx").at("bytes").get<int64_t>();
}

int64_t float_bytes(const mtrain::SafetensorsFile& f) {
  int64_t total = 0;
  for (const auto& [name, t] : f.tensors) {
    if (t.dtype() == mtrain::DType::Float32) total += t.numel() * 4;
  }
  return total;
}

// The same training on one host: two workers, and (the control) one worker alone.
struct SingleHostRuns {
  mtrain::SafetensorsFile two_workers;
  mtrain::SafetensorsFile one_worker;
};

SingleHostRuns train_on_one_host(const TempDir& dir) {
  const auto two = dir.file("one-host-two-workers.safetensors");
  const auto one = dir.file("one-host-one-worker.safetensors");
  require_success("single host, 2 workers",
                  mtrain::testing::run_process(kLauncher, concat({"--nproc_per_node=2"}, training_flags(two))));
  require_success("single host, 1 worker",
                  mtrain::testing::run_process(kLauncher, concat({"--nproc_per_node=1"}, training_flags(one))));
  return {mtrain::load_safetensors(two), mtrain::load_safetensors(one)};
}

// The checks both rendezvous share, once both agents have exited 0.
void check_two_hosts_trained_one_world(const NetnsPair& net, const TempDir& dir, const std::string& saved) {
  const auto two_hosts = mtrain::load_safetensors(saved);
  const auto reference = train_on_one_host(dir);

  const auto vs_one_host = mtrain::testing::compare_weights(two_hosts, reference.two_workers);
  const auto vs_world_of_one = mtrain::testing::compare_weights(two_hosts, reference.one_worker);
  INFO("two hosts vs one host with two workers: " << vs_one_host.describe()
                                                  << "; vs one worker alone: " << vs_world_of_one.describe());
  CHECK(vs_one_host.identical());  // Note [Multi-host equivalence]
  CHECK(vs_world_of_one.max_abs > 1e-4);

  // Each rank must receive the other's whole gradient every step (its result depends on
  // every element of it): at least kMaxSteps x the fp32 weight bytes through each end.
  // Half of that is the bound, leaving room for a narrower wire format; store traffic
  // alone is a few kilobytes.
  const int64_t gradient_bytes = kMaxSteps * float_bytes(two_hosts);
  const int64_t into_a = received_bytes(net, net.ns_a(), net.veth_a());
  const int64_t into_b = received_bytes(net, net.ns_b(), net.veth_b());
  INFO("veth bytes received: node 0 " << into_a << ", node 1 " << into_b << "; gradients " << gradient_bytes);
  CHECK(into_a >= gradient_bytes / 2);
  CHECK(into_b >= gradient_bytes / 2);
}

}  // namespace

TEST_CASE("static rendezvous: two hosts, one worker each, train what one host with two workers trains",
          "[multiproc][multihost]") {
  const auto net = netns_pair_or_skip();
  prepare_agent_environment();
  TempDir dir;
  const auto saved = dir.file("two-hosts.safetensors");
  constexpr int kPort = 29500;
  const std::vector<std::string> common = {"--nnodes=2", "--nproc_per_node=1",
                                           fmt::format("--master_addr={}", NetnsPair::kAddressA),
                                           fmt::format("--master_port={}", kPort), "--rdzv_id=multihost-static",
                                           "--rdzv_timeout=30"};
  auto node0 = start_node0_and_check_listener(*net, concat(concat(common, {"--node_rank=0"}), training_flags(saved)),
                                              kPort);
  const auto r1 = run_agent(*net, net->ns_b(), concat(concat(common, {"--node_rank=1"}), training_flags(saved)));
  const auto r0 = node0.get();
  require_success("node 0", r0);
  require_success("node 1", r1);
  // Node 1's namespace has no 198.51.100.1 of its own: joining means crossing the veth.
  CHECK_THAT(r0.err, Contains(fmt::format("hosting the rendezvous store at {}:{}", NetnsPair::kAddressA, kPort)));
  CHECK_THAT(r1.err, Contains(fmt::format("joined the rendezvous store at {}:{}", NetnsPair::kAddressA, kPort)));
  CHECK_THAT(r0.err, !Contains("loopback"));
  check_two_hosts_trained_one_world(*net, dir, saved);
}

TEST_CASE("dynamic rendezvous: the agent that owns the endpoint hosts it, and the two hosts train one world",
          "[multiproc][multihost]") {
  const auto net = netns_pair_or_skip();
  prepare_agent_environment();
  TempDir dir;
  const auto saved = dir.file("two-hosts.safetensors");
  constexpr int kPort = 29400;
  const std::vector<std::string> both = concat(
      {"--nnodes=2", "--nproc_per_node=1", fmt::format("--rdzv_endpoint={}:{}", NetnsPair::kAddressA, kPort),
       "--rdzv_id=multihost-dynamic", "--rdzv_timeout=30"},
      training_flags(saved));
  auto node_a = start_node0_and_check_listener(*net, both, kPort);
  const auto rb = run_agent(*net, net->ns_b(), both);
  const auto ra = node_a.get();
  require_success("agent in namespace A", ra);
  require_success("agent in namespace B", rb);
  // B cannot bind A's address, so it must have joined A's store rather than host one.
  CHECK_THAT(ra.err, Contains(fmt::format("hosting the rendezvous store at {}:{}", NetnsPair::kAddressA, kPort)));
  CHECK_THAT(rb.err, Contains(fmt::format("joined the rendezvous store at {}:{}", NetnsPair::kAddressA, kPort)));
  check_two_hosts_trained_one_world(*net, dir, saved);
}
