// The one-GPU-per-rank check that runs before ncclCommInitRank: the pure rule, and the
// exchange through a real store with one thread per rank.
#include <catch2/catch.hpp>

#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/nccl/device_identity.h"
#include "store/store.h"
#include "core/error.h"

using namespace mtrain;

TEST_CASE("find_shared_device: same host and PCI bus id, whatever the ranks call it") {
  CHECK_FALSE(find_shared_device({}).has_value());
  CHECK_FALSE(find_shared_device({{"a", "0000:3B:00.0", "cuda:0"}, {"a", "0000:5E:00.0", "cuda:1"}})
                  .has_value());
  // Same bus id on two hosts: two different GPUs.
  CHECK_FALSE(find_shared_device({{"a", "0000:3B:00.0", "cuda:0"}, {"b", "0000:3B:00.0", "cuda:0"}})
                  .has_value());
  // Different CUDA_VISIBLE_DEVICES: both say cuda:0 of different GPUs, or different
  // labels of the same one.
  const auto shared = find_shared_device({{"a", "0000:3B:00.0", "cuda:0"},
                                          {"a", "0000:5E:00.0", "cuda:0"},
                                          {"a", "0000:3B:00.0", "cuda:1"}});
  REQUIRE(shared.has_value());
  CHECK(shared->first == 0);
  CHECK(shared->second == 2);
}

namespace {
// Runs the check for every identity on its own thread; returns each rank's error text
// ("" when it passed).
std::vector<std::string> run_ranks(const std::vector<DeviceIdentity>& ids) {
  TcpStoreServer server("127.0.0.1", 0, "token");
  const int size = static_cast<int>(ids.size());
  std::vector<std::string> errors(ids.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      TcpStore store("127.0.0.1", server.port(), "token", Millis(10000));
      try {
        check_one_device_per_rank(store, "nccl/world/0", "world", r, size, ids[r], Millis(10000));
      } catch (const InvalidArgument& e) {
        errors[r] = e.what();
      } catch (const std::exception& e) {
        errors[r] = std::string("unexpected: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}
}  // namespace

TEST_CASE("every rank stops with the same clear error when two ranks share a GPU") {
  const auto errors = run_ranks({{"node1", "0000:3B:00.0", "cuda:0"},
                                 {"node1", "0000:5E:00.0", "cuda:1"},
                                 {"node1", "0000:3B:00.0", "cuda:0"}});
  for (const std::string& e : errors) {
    INFO(e);
    CHECK_THAT(e, Catch::Contains("nccl group 'world': ranks 0 and 2 both use the GPU at PCI bus "
                                  "0000:3B:00.0 on host node1"));
    CHECK_THAT(e, Catch::Contains("--backend gloo"));
    CHECK(e == errors[0]);
  }
}

TEST_CASE("distinct GPUs pass") {
  const auto errors = run_ranks({{"node1", "0000:3B:00.0", "cuda:0"},
                                 {"node1", "0000:5E:00.0", "cuda:1"},
                                 {"node2", "0000:3B:00.0", "cuda:0"}});
  for (const std::string& e : errors) CHECK(e.empty());
}

TEST_CASE("a rank that never publishes makes the others time out naming the key") {
  TcpStoreServer server("127.0.0.1", 0, "token");
  TcpStore store("127.0.0.1", server.port(), "token", Millis(5000));
  CHECK_THROWS_AS(check_one_device_per_rank(store, "nccl/world/0", "world", 0, 2,
                                            {"h", "0000:01:00.0", "cuda:0"}, Millis(200)),
                  TimeoutError);
}
