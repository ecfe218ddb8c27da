// Store commands end to end: a TcpStoreServer on a loopback port, TcpStore clients on
// threads of this process.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <future>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include "store/store.h"
#include "core/error.h"
#include "tests/store/store_test_util.h"

using namespace mtrain;
using namespace mtrain::testing;
using Catch::Contains;

TEST_CASE("set then get returns the bytes, including NULs and empty values", "[store]") {
  ServerFixture f;
  auto store = f.client();
  const Bytes binary = {0, 1, 2, 0xff, 0, 'x'};
  store->set("binary", binary);
  CHECK(store->get("binary") == binary);
  store->set("empty", Bytes{});
  CHECK(store->get("empty").empty());
  store->set("text", std::string("first"));
  store->set("text", std::string("second"));
  CHECK(store->get_string("text") == "second");
  // A second client sees what the first wrote.
  auto other = f.client();
  CHECK(other->get("binary") == binary);
}

TEST_CASE("a value at the size cap round-trips", "[store]") {
  ServerFixture f;
  auto store = f.client();
  Bytes big(kMaxValueBytes);
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<uint8_t>(i / 4096);
  big.back() = 0x5a;
  store->set("big", big);
  CHECK(store->get("big") == big);
}

TEST_CASE("keys and values over the caps are refused before sending", "[store]") {
  ServerFixture f;
  auto store = f.client();
  const std::string long_key(kMaxKeyBytes + 1, 'k');
  CHECK_THROWS_AS(store->set(long_key, std::string("v")), InvalidArgument);
  CHECK_THROWS_WITH(store->get(long_key), Contains("8193 bytes") && Contains("cap is 8192"));
  CHECK_THROWS_AS(store->set("k", Bytes(kMaxValueBytes + 1)), InvalidArgument);
  CHECK_THROWS_AS(store->check(std::vector<std::string>(kMaxKeysPerRequest + 1, "k")),
                  InvalidArgument);
  // The connection is still fine: nothing was sent.
  store->set("k", std::string("v"));
  CHECK(store->get_string("k") == "v");
}

TEST_CASE("get of a missing key times out naming the key", "[store]") {
  ServerFixture f;
  auto store = f.client(Millis{150});
  const auto start = Clock::now();
  CHECK_THROWS_MATCHES(store->get("never/set"), TimeoutError,
                       Catch::Matchers::Predicate<TimeoutError>([](const TimeoutError& e) {
                         const std::string m = e.what();
                         return m.find("'never/set'") != std::string::npos &&
                                m.find("0.15 s") != std::string::npos;
                       }));
  CHECK(seconds_since(start) >= 0.15);
  // The timed-out connection is replaced transparently on the next call.
  store->set("after", std::string("ok"));
  CHECK(store->get_string("after") == "ok");
}

TEST_CASE("get blocks until another client sets the key", "[store]") {
  ServerFixture f;
  auto reader = f.client();
  auto writer = f.client();
  auto pending = std::async(std::launch::async, [&] { return reader->get_string("late"); });
  CHECK(pending.wait_for(100ms) == std::future_status::timeout);
  writer->set("late", std::string("arrived"));
  CHECK(pending.get() == "arrived");
}

TEST_CASE("wait on several keys returns only once all exist", "[store]") {
  ServerFixture f;
  auto waiter = f.client();
  auto writer = f.client();
  auto pending = std::async(std::launch::async, [&] { waiter->wait({"a", "b", "c"}); });
  writer->set("a", std::string("1"));
  writer->add("b", 1);  // add creates keys too
  CHECK(pending.wait_for(100ms) == std::future_status::timeout);
  CHECK(writer->compare_set("c", {}, to_bytes("3")) == to_bytes("3"));
  CHECK(pending.wait_for(5s) == std::future_status::ready);
  pending.get();
  // Keys that already exist (and an empty list) do not block at all.
  waiter->wait({"a", "b", "c"}, Millis{1000});
  waiter->wait({}, Millis{1000});
}

TEST_CASE("wait timeout names only the keys still missing", "[store]") {
  ServerFixture f;
  auto store = f.client();
  store->set("present_key", std::string("x"));
  try {
    store->wait({"present_key", "missing_one", "missing_two"}, Millis{200});
    FAIL("wait should have timed out");
  } catch (const TimeoutError& e) {
    const std::string m = e.what();
    INFO(m);
    CHECK(m.find("'missing_one'") != std::string::npos);
    CHECK(m.find("'missing_two'") != std::string::npos);
    CHECK(m.find("present_key") == std::string::npos);
    CHECK(m.find("2 of 3") != std::string::npos);
  }
  store->set("missing_one", std::string("y"));
  store->set("missing_two", std::string("z"));
  store->wait({"present_key", "missing_one", "missing_two"}, Millis{1000});
}

TEST_CASE("a client that timed out mid-wait recovers; a recreated key wakes a waiter", "[store]") {
  ServerFixture f;
  auto writer = f.client();
  {
    // A client that times out while parked: its WAIT must not fire into a later request.
    auto quitter = f.client();
    CHECK_THROWS_AS(quitter->wait({"gate"}, Millis{50}), TimeoutError);
    writer->set("gate", std::string("open"));
    CHECK(quitter->get_string("gate") == "open");
    CHECK(quitter->num_keys() == 1);
  }
  CHECK(writer->delete_key("gate"));
  auto waiter = f.client();
  auto pending = std::async(std::launch::async, [&] { waiter->wait({"gate"}); });
  CHECK(pending.wait_for(50ms) == std::future_status::timeout);
  writer->set("gate", std::string("again"));
  pending.get();
}

TEST_CASE("check reports whether every key exists without blocking", "[store]") {
  ServerFixture f;
  auto store = f.client();
  CHECK(store->check({}));
  CHECK_FALSE(store->check({"x"}));
  store->set("x", std::string("1"));
  CHECK(store->check({"x"}));
  CHECK_FALSE(store->check({"x", "y"}));
  store->set("y", std::string("2"));
  CHECK(store->check({"x", "y"}));
}

TEST_CASE("compare_set on absent, matching and mismatching values", "[store]") {
  ServerFixture f;
  auto store = f.client();
  SECTION("absent key with empty expected sets the desired value") {
    CHECK(store->compare_set("k", {}, to_bytes("v1")) == to_bytes("v1"));
    CHECK(store->get_string("k") == "v1");
  }
  SECTION("absent key with a non-empty expected stays absent") {
    CHECK(store->compare_set("k", to_bytes("old"), to_bytes("new")).empty());
    CHECK_FALSE(store->check({"k"}));
  }
  SECTION("matching value is replaced") {
    store->set("k", std::string("old"));
    CHECK(store->compare_set("k", to_bytes("old"), to_bytes("new")) == to_bytes("new"));
    CHECK(store->get_string("k") == "new");
  }
  SECTION("mismatching value is kept and returned") {
    store->set("k", std::string("current"));
    CHECK(store->compare_set("k", to_bytes("other"), to_bytes("new")) == to_bytes("current"));
    CHECK(store->get_string("k") == "current");
  }
  SECTION("present empty value matches an empty expected") {
    store->set("k", Bytes{});
    CHECK(store->compare_set("k", {}, to_bytes("filled")) == to_bytes("filled"));
  }
}

TEST_CASE("add counts, parses set values and rejects non-integers", "[store]") {
  ServerFixture f;
  auto store = f.client();
  CHECK(store->add("n", 5) == 5);
  CHECK(store->add("n", -7) == -2);
  CHECK(store->add("n", 0) == -2);
  CHECK(store->get_string("n") == "-2");
  store->set("from_set", std::string("41"));
  CHECK(store->add("from_set", 1) == 42);
  store->set("word", std::string("abc"));
  CHECK_THROWS_MATCHES(store->add("word", 1), InvalidArgument,
                       Catch::Matchers::Predicate<InvalidArgument>([](const InvalidArgument& e) {
                         const std::string m = e.what();
                         return m.find("'word'") != std::string::npos &&
                                m.find("'abc'") != std::string::npos;
                       }));
  store->set("big", std::to_string(INT64_MAX));
  CHECK_THROWS_WITH(store->add("big", 1), Contains("overflows"));
  // The error did not cost the connection or the value.
  CHECK(store->get_string("word") == "abc");
  CHECK(store->add("n", 2) == 0);
}

TEST_CASE("add from many threads sums exactly and hands out distinct values", "[store]") {
  ServerFixture f;
  constexpr int kThreads = 8;
  constexpr int kAddsPerThread = 250;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto store = f.client();
      for (int i = 0; i < kAddsPerThread; ++i) seen[t].push_back(store->add("counter", 1));
    });
  }
  for (auto& t : threads) t.join();
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(kThreads * kAddsPerThread);
  std::iota(expected.begin(), expected.end(), 1);
  CHECK(all == expected);
  CHECK(f.client()->add("counter", 0) == kThreads * kAddsPerThread);
}

TEST_CASE("delete_key and num_keys", "[store]") {
  ServerFixture f;
  auto store = f.client(Millis{100});
  CHECK(store->num_keys() == 0);
  store->set("a", std::string("1"));
  store->set("b", std::string("2"));
  store->add("c", 3);
  CHECK(store->num_keys() == 3);
  CHECK(store->delete_key("b"));
  CHECK_FALSE(store->delete_key("b"));
  CHECK_FALSE(store->delete_key("never"));
  CHECK(store->num_keys() == 2);
  CHECK_FALSE(store->check({"b"}));
  CHECK_THROWS_AS(store->get("b"), TimeoutError);
}

TEST_CASE("barrier releases nobody early and a name can be reused", "[store]") {
  ServerFixture f;
  constexpr int kParticipants = 6;
  constexpr int kRounds = 3;
  std::atomic<int> arrived{0};
  std::atomic<int> early{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kParticipants; ++t) {
    threads.emplace_back([&, t] {
      auto store = f.client();
      for (int round = 1; round <= kRounds; ++round) {
        // Stagger arrivals so that a broken barrier would let someone through.
        std::this_thread::sleep_for(Millis{5 * ((t + round) % kParticipants)});
        arrived.fetch_add(1);
        store->barrier("step", kParticipants, Millis{10'000});
        if (arrived.load() < round * kParticipants) early.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(early.load() == 0);
  CHECK(arrived.load() == kParticipants * kRounds);
  // Per name: the counter and the latest generation's done key.
  CHECK(f.client()->num_keys() == 2);
}

TEST_CASE("barrier timeout says how many arrived", "[store]") {
  ServerFixture f;
  auto first = f.client();
  auto second = f.client();
  auto other = std::async(std::launch::async,
                          [&] { second->barrier("partial", 3, Millis{300}); });
  CHECK_THROWS_WITH(first->barrier("partial", 3, Millis{300}),
                    Contains("barrier 'partial'") && Contains("2 of 3"));
  CHECK_THROWS_AS(other.get(), TimeoutError);
  CHECK_THROWS_AS(first->barrier("bad", 0, Millis{100}), InvalidArgument);
}

TEST_CASE("200 concurrent clients each set, get and add", "[store]") {
  ServerFixture f;
  constexpr int kClients = 200;
  std::vector<std::string> failures(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      try {
        auto store = f.client();
        store->set("client/" + std::to_string(i), std::to_string(i * 7));
        store->add("clients", 1);
        // Reading a neighbour's key makes clients wait on each other through the server.
        const int next = (i + 1) % kClients;
        if (store->get_string("client/" + std::to_string(next)) != std::to_string(next * 7)) {
          failures[i] = "wrong value for neighbour";
        }
      } catch (const std::exception& e) {
        failures[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    INFO("client " << i);
    CHECK(failures[i].empty());
  }
  CHECK(f.client()->add("clients", 0) == kClients);
}

TEST_CASE("PrefixStore prefixes every key and shares the base store", "[store]") {
  ServerFixture f;
  auto base = f.client();
  PrefixStore job("job1", *base);
  PrefixStore nested("rank0", job);
  job.set("k", std::string("v"));
  CHECK(base->get_string("job1/k") == "v");
  CHECK(job.get_string("k") == "v");
  nested.set("k", std::string("deep"));
  CHECK(base->get_string("job1/rank0/k") == "deep");
  CHECK(job.add("n", 2) == 2);
  CHECK(base->add("job1/n", 0) == 2);
  CHECK(job.compare_set("n", to_bytes("2"), to_bytes("9")) == to_bytes("9"));
  CHECK(job.check({"k", "n"}));
  CHECK_FALSE(job.check({"job1/k"}));
  job.wait({"k", "n"}, Millis{1000});
  CHECK(job.num_keys() == base->num_keys());
  CHECK(job.delete_key("k"));
  CHECK_FALSE(base->check({"job1/k"}));
  job.barrier("sync", 1, Millis{1000});
  CHECK(base->check({"job1/__barrier/sync/arrived"}));
}

TEST_CASE("PrefixStore get honours its own timeout", "[store]") {
  ServerFixture f;
  auto base = f.client(Millis{30'000});
  PrefixStore view("p", *base);
  CHECK(view.timeout() == base->timeout());
  view.set_timeout(Millis{100});
  const auto start = Clock::now();
  CHECK_THROWS_WITH(view.get("absent"), Contains("'p/absent'"));
  CHECK(seconds_since(start) < 10.0);
}

TEST_CASE("generate_store_token gives 64 fresh hex digits", "[store]") {
  const std::string a = generate_store_token();
  const std::string b = generate_store_token();
  CHECK(a.size() == 64);
  CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(a != b);
}
