// Work, reduce-op names, the backend factory, and call-time validation on a one-rank
// gloo group (its store server runs in this process).
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "collectives/gloo/gloo_device.h"
#include "collectives/process_group.h"
#include "core/error.h"
#include "tests/support/scoped_env.h"

using namespace mtrain;

TEST_CASE("Work: wait returns once completed, from another thread") {
  auto work = std::make_shared<Work>(OpType::AllReduce, 7);
  CHECK_FALSE(work->is_completed());
  std::thread finisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    work->mark_completed();
  });
  work->wait();
  finisher.join();
  CHECK(work->is_completed());
  CHECK(work->error() == nullptr);
  CHECK_NOTHROW(work->wait(Millis(1)));
  CHECK_THROWS_AS(work->mark_completed(), InternalError);
}

TEST_CASE("Work: wait(timeout) names the operation and its sequence number") {
  Work work(OpType::ReduceScatter, 42);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(work.wait(Millis(50)), Catch::Contains("reduce_scatter #42"));
  CHECK(std::chrono::steady_clock::now() - start >= Millis(50));
  CHECK_THROWS_AS(work.wait(Millis(1)), TimeoutError);
}

TEST_CASE("Work: the operation's error reaches every waiter") {
  Work work(OpType::Broadcast, 3);
  work.mark_failed(std::make_exception_ptr(CommError("peer 2 went away")));
  CHECK(work.is_completed());
  REQUIRE(work.error() != nullptr);
  CHECK_THROWS_AS(work.wait(), CommError);
  CHECK_THROWS_WITH(work.wait(Millis(10)), "peer 2 went away");
  CHECK_THROWS_AS(work.mark_failed(std::make_exception_ptr(CommError("again"))), InternalError);
}

TEST_CASE("reduce op and op type names") {
  for (const char* name : {"sum", "avg", "max", "min"}) CHECK(reduce_op_name(parse_reduce_op(name)) == std::string(name));
  CHECK_THROWS_WITH(parse_reduce_op("prod"), Catch::Contains("sum, avg, max, min"));
  CHECK(op_type_name(OpType::AllGatherV) == std::string("allgatherv"));
}

TEST_CASE("factory: unknown and unbuilt backends list the available ones") {
  const auto names = available_backends();
  REQUIRE(names.front() == "gloo");
  CHECK_THROWS_AS(create_process_group("tcp", nullptr, 0, 1, Device::cpu()), InvalidArgument);
  CHECK_THROWS_WITH(create_process_group("tcp", nullptr, 0, 1, Device::cpu()),
                    Catch::Contains("unknown process group backend 'tcp'") && Catch::Contains("gloo"));
  const bool nccl_built = std::find(names.begin(), names.end(), "nccl") != names.end();
  if (nccl_built) {
    CHECK_THROWS_WITH(create_process_group("nccl", nullptr, 0, 1, Device::cpu()),
                      Catch::Contains("works on GPU tensors") && Catch::Contains("found device cpu"));
  } else {
    CHECK_THROWS_WITH(create_process_group("nccl", nullptr, 0, 1, Device::cpu()),
                      Catch::Contains("nccl backend is not built in") && Catch::Contains("gloo"));
  }
  CHECK_THROWS_WITH(create_process_group("auto", nullptr, 0, 1, Device::cuda(0)),
                    Catch::Contains("nccl"));
  CHECK_THROWS_WITH(create_process_group("gloo", nullptr, 0, 1, Device::cpu()),
                    Catch::Contains("needs a rendezvous store"));
  if (std::find(names.begin(), names.end(), "mpi") == names.end()) {
    CHECK_THROWS_WITH(create_process_group("mpi", nullptr, 0, 1, Device::cpu()),
                      Catch::Contains("not built in"));
  }
}

namespace {

struct OneRankGloo {
  TcpStoreServer server{"127.0.0.1", 0, "unit-token"};
  std::shared_ptr<Store> store =
      std::make_shared<TcpStore>("127.0.0.1", server.port(), "unit-token", Millis(5000));
  std::unique_ptr<ProcessGroup> pg;
  explicit OneRankGloo(const std::string& name) {
    ProcessGroupOptions options;
    options.name = name;
    options.timeout = Millis(5000);
    pg = create_process_group("gloo", store, 0, 1, Device::cpu(), options);
  }
};

}  // namespace

TEST_CASE("gloo: a group destroyed as soon as it is created fails no peer") {
  // Note [Connected on every rank]: each of two ranks creates a group and drops it at
  // once, many times over; a rank whose connect returned before its peer's must not
  // close the connection under the peer still connecting.
  TcpStoreServer server("127.0.0.1", 0, "unit-token");
  constexpr int kRounds = 40;
  std::string errors[2];
  auto rank_body = [&](int rank) {
    auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), "unit-token", Millis(10000));
    ProcessGroupOptions options;
    options.timeout = Millis(10000);
    for (int round = 0; round < kRounds && errors[rank].empty(); ++round) {
      options.name = fmt::format("short-lived-{}", round);
      try {
        create_process_group("gloo", store, rank, 2, Device::cpu(), options).reset();
      } catch (const std::exception& e) {
        errors[rank] = fmt::format("round {}: {}", round, e.what());
      }
    }
  };
  std::thread peer(rank_body, 1);
  rank_body(0);
  peer.join();
  INFO("rank 0: " << errors[0] << " | rank 1: " << errors[1]);
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
}

TEST_CASE("gloo: bad ranks and shapes are rejected at the call") {
  TcpStoreServer server("127.0.0.1", 0, "unit-token");
  auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), "unit-token", Millis(5000));
  CHECK_THROWS_WITH(create_process_group("gloo", store, 2, 2, Device::cpu()),
                    Catch::Contains("expected a rank in [0, 2), found 2"));

  OneRankGloo g("shapes");
  ProcessGroup& pg = *g.pg;
  CHECK(pg.backend_name() == "gloo");
  Tensor in = Tensor::full({4}, 1.0f);
  Tensor wrong = Tensor::zeros({3});
  CHECK_THROWS_WITH(pg.allgather(in, wrong), Catch::Contains("expected an output of 1 x 4 = 4 elements, found 3"));
  Tensor odd = Tensor::zeros({3});
  Tensor two = Tensor::zeros({2});
  CHECK_THROWS_WITH(pg.reduce_scatter(odd, two), Catch::Contains("found 3"));
  CHECK_THROWS_WITH(pg.allgatherv(in, in, {4, 4}), Catch::Contains("expected 1 counts"));
  CHECK_THROWS_WITH(pg.allgatherv(in, in, {3}), Catch::Contains("input has 4"));
  CHECK_THROWS_WITH(pg.broadcast(in, 1), Catch::Contains("root in [0, 1), found 1"));
  Tensor bytes = Tensor::zeros({4}, DType::UInt8);
  CHECK_THROWS_WITH(pg.allreduce(bytes), Catch::Contains("found uint8"));
  Tensor ints = Tensor::zeros({4}, DType::Int64);
  CHECK_THROWS_WITH(pg.allreduce(ints, ReduceOp::Avg),
                    Catch::Contains("allreduce in group 'shapes': avg of int64 would truncate"));
  CHECK_THROWS_WITH(pg.allgather(in, ints), Catch::Contains("input and output dtypes differ: float32 vs int64"));
  CHECK_THROWS_WITH(pg.allgatherv(in, in, {-1}), Catch::Contains("counts[0] is negative (-1)"));
  Tensor eight = Tensor::zeros({8});
  CHECK_THROWS_WITH(pg.allgatherv(in, eight, {4}), Catch::Contains("sum(counts) = 4 elements, found 8"));

  // Rejected calls take no sequence number: the next operation is #0.
  Tensor t = Tensor::full({4}, 2.5f);
  WorkPtr w = pg.allreduce(t, ReduceOp::Avg);
  CHECK(w->seq() == 0);
  w->wait(Millis(5000));
  CHECK(t.to_vector<float>() == std::vector<float>(4, 2.5f));
  Tensor empty = Tensor::zeros({0});
  WorkPtr e = pg.allreduce(empty);
  CHECK(e->seq() == 1);
  e->wait(Millis(5000));
  CHECK(pg.barrier()->seq() == 2);
}

namespace {

std::set<pid_t> thread_ids() {
  std::set<pid_t> ids;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    ids.insert(static_cast<pid_t>(std::stol(entry.path().filename().string())));
  }
  return ids;
}

// The scheduling policy and nice value of each thread the device started (Gloo starts
// one: its loop). The helper thread that creates the device is joined, but a joined
// thread can stay listed in /proc/self/task a little longer, so the scan repeats until
// one new thread is left (or 2 s have passed).
std::vector<std::pair<int, int>> policies_of_new_threads(LoopScheduling loop) {
  const std::set<pid_t> before = thread_ids();
  auto device = create_tcp_device(LocalAddress{"127.0.0.1", AF_INET}, loop);
  std::vector<std::pair<int, int>> policies;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  do {
    policies.clear();
    for (pid_t tid : thread_ids()) {
      if (before.count(tid)) continue;
      const int policy = sched_getscheduler(tid);
      errno = 0;
      const int nice = getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
      if (policy < 0 || errno != 0) continue;  // gone since the directory was read
      policies.emplace_back(policy, nice);
    }
    if (policies.size() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } while (std::chrono::steady_clock::now() < deadline);
  return policies;
}

}  // namespace

TEST_CASE("Gloo's event-loop thread runs at nice 10, or as chosen; its creator keeps its own") {
  // Note [Gloo event-loop priority].
  using Policies = std::vector<std::pair<int, int>>;
  const int own_nice = getpriority(PRIO_PROCESS, 0);
  CHECK(policies_of_new_threads(LoopScheduling::Nice) == Policies{{SCHED_OTHER, std::max(own_nice, kGlooLoopNice)}});
  const auto idle = policies_of_new_threads(LoopScheduling::Idle);
  REQUIRE(idle.size() == 1);
  CHECK(idle[0].first == SCHED_IDLE);
  CHECK(policies_of_new_threads(LoopScheduling::Normal) == Policies{{SCHED_OTHER, own_nice}});
  CHECK(sched_getscheduler(0) == SCHED_OTHER);
  CHECK(getpriority(PRIO_PROCESS, 0) == own_nice);
}

TEST_CASE("MTRAIN_GLOO_LOOP_SCHED chooses the loop's scheduling; bad values are named") {
  {
    testing::ScopedEnv unset("MTRAIN_GLOO_LOOP_SCHED", std::nullopt);
    CHECK(loop_scheduling_from_env() == LoopScheduling::Nice);
  }
  {
    testing::ScopedEnv idle("MTRAIN_GLOO_LOOP_SCHED", "idle");
    CHECK(loop_scheduling_from_env() == LoopScheduling::Idle);
  }
  {
    testing::ScopedEnv normal("MTRAIN_GLOO_LOOP_SCHED", "normal");
    CHECK(loop_scheduling_from_env() == LoopScheduling::Normal);
  }
  testing::ScopedEnv bad("MTRAIN_GLOO_LOOP_SCHED", "realtime");
  CHECK_THROWS_WITH(loop_scheduling_from_env(),
                    Catch::Contains("MTRAIN_GLOO_LOOP_SCHED") && Catch::Contains("'realtime'"));
}

TEST_CASE("gloo listens where other hosts can reach it, also when the master is this host's own name") {
  // Note [Gloo on the master's own name]: loopback literals stay loopback (one node)...
  CHECK(mtrain::local_address_reaching("127.0.0.1", 29500).ip == "127.0.0.1");
  // ...but this host's own name, which /etc/hosts often maps to 127.0.0.1 or 127.0.1.1,
  // must give an address of a real interface when there is one.
  char own[256] = {};
  REQUIRE(::gethostname(own, sizeof own - 1) == 0);
  bool has_interface = false;
  ifaddrs* list = nullptr;
  REQUIRE(::getifaddrs(&list) == 0);
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) &&
        !(i->ifa_flags & IFF_LOOPBACK)) {
      has_interface = true;
    }
  }
  ::freeifaddrs(list);
  addrinfo* resolved = nullptr;
  const bool own_resolves = ::getaddrinfo(own, nullptr, nullptr, &resolved) == 0;
  if (resolved != nullptr) ::freeaddrinfo(resolved);
  if (!has_interface || !own_resolves) {
    WARN("skipped the own-name case: " << (own_resolves ? "no IPv4 interface besides loopback"
                                                        : "this host's name does not resolve"));
  } else {
    const auto a = mtrain::local_address_reaching(own, 29500);
    INFO(own << " -> " << a.ip);
    CHECK(a.ip.rfind("127.", 0) != 0);
    CHECK(a.ip != "::1");
  }
  // GLOO_SOCKET_IFNAME names the interface outright; a wrong name is a clear error.
  {
    mtrain::testing::ScopedEnv ifname("GLOO_SOCKET_IFNAME", "lo");
    CHECK(mtrain::local_address_reaching("203.0.113.7", 29500).ip == "127.0.0.1");
  }
  mtrain::testing::ScopedEnv wrong("GLOO_SOCKET_IFNAME", "nosuchif0,lo");
  CHECK_THROWS_WITH(mtrain::local_address_reaching("127.0.0.1", 29500),
                    Catch::Contains("GLOO_SOCKET_IFNAME=nosuchif0,lo: expected an interface of this host") &&
                        Catch::Contains("found none named 'nosuchif0'"));
}
