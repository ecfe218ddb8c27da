// The server under hostile or broken peers: malformed frames over raw sockets, silent
// and stalled connections, clients that never read, and shutdown with clients attached.
#include <catch2/catch.hpp>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "store/store.h"
#include "store/wire.h"
#include "core/error.h"
#include "tests/store/store_test_util.h"

using namespace mtrain;
using namespace mtrain::testing;
using namespace mtrain::store_wire;
using Catch::Contains;

namespace {

Bytes raw_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

Bytes length_prefix(uint32_t n) {
  return {static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8), static_cast<uint8_t>(n >> 16),
          static_cast<uint8_t>(n >> 24)};
}

Bytes concat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

void require_server_still_serves(ServerFixture& f) {
  auto good = f.client();
  good->set("still/alive", std::string("yes"));
  CHECK(good->get_string("still/alive") == "yes");
}

struct MalformedCase {
  const char* name;
  bool authenticate_first;
  Bytes bytes;
  bool close_after_sending;  // the client hangs up itself (a frame cut in half)
};

std::vector<MalformedCase> malformed_cases(const std::string& token) {
  const Bytes set_frame =
      FrameWriter().op(Opcode::kSet).bytes(std::string("key")).bytes(Bytes(64, 'v')).finish();
  return {
      {"garbage bytes before the handshake", false,
       raw_bytes("GET / HTTP/1.1\r\nHost: store\r\n\r\n"), false},
      {"a command before the handshake (no token)", false, set_frame, false},
      {"a HELLO with the wrong magic", false,
       FrameWriter().op(Opcode::kHello).u32(0xdeadbeef).u32(kProtocolVersion).bytes(token).finish(),
       false},
      {"a HELLO token longer than the cap", false,
       FrameWriter()
           .op(Opcode::kHello)
           .u32(kHelloMagic)
           .u32(kProtocolVersion)
           .bytes(std::string(kMaxTokenBytes + 1, 't'))
           .finish(),
       false},
      {"garbage bytes after the handshake", true, Bytes(16, 0xff), false},
      {"a length prefix over the cap", true,
       concat(length_prefix(static_cast<uint32_t>(kMaxFrameBytes + 1)), Bytes(8, 0)), false},
      {"an empty frame", true, length_prefix(0), false},
      {"an unknown opcode", true, FrameWriter().u8(0x7f).finish(), false},
      {"a key over the cap", true,
       FrameWriter()
           .op(Opcode::kSet)
           .bytes(std::string(kMaxKeyBytes + 1, 'k'))
           .bytes(std::string("v"))
           .finish(),
       false},
      {"a key count over the cap", true,
       FrameWriter().op(Opcode::kCheck).u32(static_cast<uint32_t>(kMaxKeysPerRequest + 1)).finish(),
       false},
      {"a field running past the end of its frame", true,
       FrameWriter().op(Opcode::kGet).u32(100).u8('x').finish(), false},
      {"trailing bytes after a complete request", true,
       FrameWriter().op(Opcode::kNumKeys).u8(0).finish(), false},
      {"a frame cut in half, then close", true, Bytes(set_frame.begin(), set_frame.begin() + 30),
       true},
      {"a HELLO after the handshake", true,
       FrameWriter().op(Opcode::kHello).u32(kHelloMagic).u32(kProtocolVersion).bytes(token).finish(),
       false},
  };
}

}  // namespace

TEST_CASE("malformed frames close only that connection and are counted", "[store]") {
  ServerFixture f;
  // A connection the server must keep serving throughout.
  auto bystander = f.client();
  bystander->set("bystander", std::string("here"));
  for (const auto& c : malformed_cases(f.token)) {
    INFO(c.name);
    const uint64_t before = f.server.rejected_connections();
    {
      RawConnection raw(f.server.port());
      REQUIRE(raw.connect_errno() == 0);
      if (c.authenticate_first) raw.authenticate(f.token);
      raw.send(c.bytes);
      if (!c.close_after_sending) CHECK(raw.closed_by_peer_within(Millis{3000}));
    }
    CHECK(eventually([&] { return f.server.rejected_connections() == before + 1; }));
    require_server_still_serves(f);
    CHECK(bystander->get_string("bystander") == "here");
  }
}

TEST_CASE("a HELLO with the right token but another protocol version gets an error", "[store]") {
  ServerFixture f;
  RawConnection raw(f.server.port());
  raw.send(FrameWriter().op(Opcode::kHello).u32(kHelloMagic).u32(99).bytes(f.token).finish());
  const auto reply = raw.read_frame();
  REQUIRE(reply.has_value());
  FrameReader r(reply->data(), reply->size());
  CHECK(r.u8("status") == static_cast<uint8_t>(Status::kError));
  CHECK(r.u8("kind") == static_cast<uint8_t>(ErrorKind::kUnsupported));
  CHECK_THAT(r.string(kMaxErrorMessageBytes, "message"), Contains("version 1"));
}

TEST_CASE("a request sent together with a WAIT is answered after it", "[store]") {
  ServerFixture f;
  RawConnection raw(f.server.port());
  raw.authenticate(f.token);
  const Bytes wait = FrameWriter().op(Opcode::kWait).key_list({"gate"}).finish();
  const Bytes count = FrameWriter().op(Opcode::kNumKeys).finish();
  raw.send(concat(wait, count));
  CHECK_FALSE(raw.read_frame(Millis{100}).has_value());
  f.client()->set("gate", std::string("open"));
  const auto wait_reply = raw.read_frame();
  REQUIRE(wait_reply.has_value());
  CHECK(*wait_reply == Bytes{static_cast<uint8_t>(Status::kOk)});
  const auto count_reply = raw.read_frame();
  REQUIRE(count_reply.has_value());
  FrameReader r(count_reply->data(), count_reply->size());
  CHECK(r.u8("status") == static_cast<uint8_t>(Status::kOk));
  CHECK(r.i64("count") == 1);
}

TEST_CASE("a request sent while a WAIT is parked closes the connection", "[store]") {
  ServerFixture f;
  const uint64_t before = f.server.rejected_connections();
  RawConnection raw(f.server.port());
  raw.authenticate(f.token);
  raw.send(FrameWriter().op(Opcode::kWait).key_list({"never"}).finish());
  std::this_thread::sleep_for(200ms);  // let the server park it
  raw.send(FrameWriter().op(Opcode::kNumKeys).finish());
  CHECK(raw.closed_by_peer_within(Millis{3000}));
  CHECK(eventually([&] { return f.server.rejected_connections() == before + 1; }));
  require_server_still_serves(f);
}

TEST_CASE("silent and stalled connections block nobody; unauthenticated ones are dropped",
          "[store]") {
  ServerFixture f;
  const uint64_t before = f.server.rejected_connections();
  const Bytes hello =
      FrameWriter().op(Opcode::kHello).u32(kHelloMagic).u32(kProtocolVersion).bytes(f.token).finish();
  const auto opened = Clock::now();
  RawConnection silent(f.server.port());
  RawConnection half_hello(f.server.port());
  half_hello.send(Bytes(hello.begin(), hello.begin() + hello.size() / 2));
  RawConnection half_request(f.server.port());
  half_request.authenticate(f.token);
  const Bytes set_frame =
      FrameWriter().op(Opcode::kSet).bytes(std::string("stalled")).bytes(Bytes(1000, 1)).finish();
  half_request.send(Bytes(set_frame.begin(), set_frame.begin() + 100));

  // Meanwhile everyone else is served at once.
  auto good = f.client(Millis{2000});
  for (int i = 0; i < 20; ++i) good->add("busy", 1);
  CHECK(good->get_string("busy") == "20");

  // The two that never authenticated are dropped after the handshake deadline (5 s).
  CHECK(silent.closed_by_peer_within(Millis{8000}));
  CHECK(half_hello.closed_by_peer_within(Millis{1000}));
  CHECK(seconds_since(opened) >= 4.5);
  CHECK(eventually([&] { return f.server.rejected_connections() == before + 2; }));
  // An authenticated connection may idle mid-frame; it is not dropped.
  CHECK_FALSE(half_request.closed_by_peer_within(Millis{100}));
  half_request.send(Bytes(set_frame.begin() + 100, set_frame.end()));
  const auto reply = half_request.read_frame();
  REQUIRE(reply.has_value());
  CHECK((*reply)[0] == static_cast<uint8_t>(Status::kOk));
  CHECK(good->get("stalled") == Bytes(1000, 1));
}

TEST_CASE("a client that never reads its replies does not block others", "[store]") {
  ServerFixture f;
  auto good = f.client(Millis{5000});
  good->set("big", Bytes(1 << 20, 7));
  RawConnection hog(f.server.port());
  hog.authenticate(f.token);
  Bytes requests;
  const Bytes get_big = FrameWriter().op(Opcode::kGet).bytes(std::string("big")).finish();
  for (int i = 0; i < 64; ++i) requests.insert(requests.end(), get_big.begin(), get_big.end());
  hog.send(requests);  // 64 MiB of replies that nobody reads
  for (int i = 0; i < 20; ++i) good->set(fmt::format("k{}", i), std::string("v"));
  CHECK(good->num_keys() == 21);
  const auto first = hog.read_frame();
  REQUIRE(first.has_value());
  CHECK(first->size() == 1 + 4 + (1 << 20));
}

TEST_CASE("server destructor returns promptly with clients connected and waiting", "[store]") {
  auto f = std::make_unique<ServerFixture>();
  auto idle = f->client();
  auto waiter = f->client(Millis{30'000});
  RawConnection unauthenticated(f->server.port());
  auto pending = std::async(std::launch::async, [&] { waiter->wait({"never"}); });
  CHECK(pending.wait_for(100ms) == std::future_status::timeout);
  const auto start = Clock::now();
  f.reset();
  CHECK(seconds_since(start) < 2.0);
  REQUIRE(pending.wait_for(5s) == std::future_status::ready);
  CHECK_THROWS_WITH(pending.get(), Contains("closed the connection"));
  CHECK(unauthenticated.closed_by_peer_within(Millis{1000}));
}

TEST_CASE("a client whose server vanished gets a CommError, not a hang or SIGPIPE", "[store]") {
  // With the default action a write to a dead socket would kill this process.
  std::signal(SIGPIPE, SIG_DFL);
  auto f = std::make_unique<ServerFixture>();
  const uint16_t port = f->server.port();
  TcpStore store("127.0.0.1", port, f->token, Millis{2000}, Millis{300});
  store.set("k", std::string("v"));
  f.reset();
  CHECK_THROWS_AS(store.set("k", Bytes(4 << 20, 1)), CommError);
  // The next call tries to reconnect for connect_timeout and names the address.
  CHECK_THROWS_WITH(store.get("k"), Contains("could not reach the store at 127.0.0.1:" +
                                             std::to_string(port)));
}

// Note [Store connection limits]: connecting needs no token, so connections are bounded.
TEST_CASE("connections waiting for the handshake are capped: the oldest makes room", "[store]") {
  ServerFixture f;
  const uint64_t before = f.server.rejected_connections();
  constexpr int kPendingCap = 128;  // kMaxPendingHandshakes in store/server.cpp
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i <= kPendingCap; ++i) {
    idle.push_back(std::make_unique<RawConnection>(f.server.port()));
    REQUIRE(idle.back()->connect_errno() == 0);
  }
  // All young: a burst of real clients looks the same, so nobody is closed yet.
  CHECK_FALSE(idle.front()->closed_by_peer_within(Millis{1100}));
  // Once they have been silent for 1 s, a newcomer closes the oldest (the server accepts
  // in connection order), long before the 5 s handshake deadline would.
  RawConnection newcomer(f.server.port());
  CHECK(idle.front()->closed_by_peer_within(Millis{1000}));
  CHECK_FALSE(idle[1]->closed_by_peer_within(Millis{50}));
  CHECK_FALSE(newcomer.closed_by_peer_within(Millis{50}));
  CHECK(f.server.rejected_connections() == before + 1);
  require_server_still_serves(f);
}

namespace {

// Lowers the soft RLIMIT_NOFILE for the scope of a test.
class ScopedFileLimit {
 public:
  explicit ScopedFileLimit(rlim_t soft) {
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved_) == 0);
    rlimit lowered = saved_;
    lowered.rlim_cur = soft;
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &lowered) == 0);
  }
  ~ScopedFileLimit() { ::setrlimit(RLIMIT_NOFILE, &saved_); }

 private:
  rlimit saved_{};
};

}  // namespace

TEST_CASE("a burst of real clients beyond the pending cap all get in", "[store]") {
  // A job's ranks connect at once: their HELLOs are on the wire before the server has
  // accepted them all, and none of them may be taken for an idle peer.
  ServerFixture f;
  const uint64_t before = f.server.rejected_connections();
  constexpr int kBurst = 300;  // more than twice the 128 pending places
  std::vector<std::unique_ptr<RawConnection>> burst;
  const Bytes hello =
      FrameWriter().op(Opcode::kHello).u32(kHelloMagic).u32(kProtocolVersion).bytes(f.token).finish();
  for (int i = 0; i < kBurst; ++i) {
    burst.push_back(std::make_unique<RawConnection>(f.server.port()));
    REQUIRE(burst.back()->connect_errno() == 0);
    burst.back()->send(hello);
  }
  for (int i = 0; i < kBurst; ++i) {
    INFO("connection " << i);
    const auto reply = burst[static_cast<size_t>(i)]->read_frame(Millis{5000});
    REQUIRE(reply.has_value());
    CHECK((*reply)[0] == static_cast<uint8_t>(Status::kOk));
  }
  CHECK(f.server.rejected_connections() == before);
}

TEST_CASE("at the descriptor limit the server stops accepting until a connection closes",
          "[store]") {
  std::ostringstream captured;
  const auto previous = spdlog::default_logger();
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(captured)));
  struct Restore {
    std::shared_ptr<spdlog::logger> logger;
    ~Restore() { spdlog::set_default_logger(logger); }
  } restore{previous};
  // 256 descriptors are kept for the rest of the process: 320 leaves room for 64
  // connections (kReservedDescriptors, kMinConnections in store/server.cpp). The server
  // reads the limit when it starts.
  constexpr int kCap = 64;
  ScopedFileLimit limit(320);
  ServerFixture f;
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < kCap; ++i) {
    held.push_back(std::make_unique<RawConnection>(f.server.port()));
    held.back()->authenticate(f.token);
  }
  // One more connects (the kernel's backlog takes it) but is not served...
  RawConnection late(f.server.port());
  REQUIRE(late.connect_errno() == 0);
  late.send(FrameWriter().op(Opcode::kHello).u32(kHelloMagic).u32(kProtocolVersion).bytes(f.token).finish());
  CHECK_FALSE(late.read_frame(Millis{300}).has_value());
  // ...and the server says why, once.
  CHECK_THAT(captured.str(), Contains("64 connections, the most this process's open-file limit allows"));
  // ...until one of the others leaves.
  held.front().reset();
  const auto reply = late.read_frame(Millis{3000});
  REQUIRE(reply.has_value());
  CHECK((*reply)[0] == static_cast<uint8_t>(Status::kOk));
}

TEST_CASE("peers without the token cannot flood the log", "[store]") {
  std::ostringstream captured;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured);
  const auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  struct Restore {
    std::shared_ptr<spdlog::logger> logger;
    ~Restore() { spdlog::set_default_logger(logger); }
  } restore{previous};

  ServerFixture f;
  const uint64_t before = f.server.rejected_connections();
  // Port probes: connect and leave without a byte. Not worth a warning.
  for (int i = 0; i < 20; ++i) RawConnection probe(f.server.port());
  // Garbage: each one is a warning, but only the first 10 in 10 s are written.
  for (int i = 0; i < 30; ++i) {
    RawConnection junk(f.server.port());
    junk.send(raw_bytes("GET / HTTP/1.1\r\n\r\n"));
    CHECK(junk.closed_by_peer_within(Millis{2000}));
  }
  REQUIRE(eventually([&] { return f.server.rejected_connections() == before + 50; }));
  const std::string log = captured.str();
  INFO(log);
  CHECK(std::count(log.begin(), log.end(), '\n') == 10);
  CHECK_THAT(log, Contains("closing the connection from 127.0.0.1"));
  CHECK_THAT(log, !Contains("without a byte"));
}

TEST_CASE("8,000 idle connections: every real client meanwhile gets through its handshake", "[store]") {
  // Note [Store connection limits]: the server must not stop accepting while the idle
  // connections are young, or the kernel's backlog overflows and a real client's
  // connection waits out SYN retransmissions there (seconds each), past its timeout.
  constexpr int kIdle = 8000;
  rlimit files{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &files) == 0);
  const rlim_t needed = 2 * kIdle + 512;  // both ends live in this process
  if (files.rlim_max != RLIM_INFINITY && files.rlim_max < needed) {
    WARN("skipped: the hard open-file limit " << files.rlim_max << " is below the " << needed << " this needs");
    return;
  }
  ScopedFileLimit limit(files.rlim_max == RLIM_INFINITY ? needed : files.rlim_max);
  ServerFixture f;
  std::atomic<bool> flooding{true};
  int ok = 0;
  std::vector<std::string> failures;
  std::thread real_clients([&] {
    // A timeout of 3 s: one dropped SYN costs 1 s, two 3 s.
    for (int i = 0; flooding.load(); ++i) {
      try {
        TcpStore c("127.0.0.1", f.server.port(), f.token, Millis{3000}, Millis{3000});
        c.set(fmt::format("real/{}", i), std::string("v"));
        ++ok;
      } catch (const Error& e) {  // CommError, TimeoutError
        failures.push_back(e.what());
      }
    }
  });
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i < kIdle; ++i) {
    idle.push_back(std::make_unique<RawConnection>(f.server.port()));
    REQUIRE(idle.back()->connect_errno() == 0);
  }
  // Past the grace, when the newest idle ones start making room, and the first
  // handshake deadlines.
  std::this_thread::sleep_for(6s);
  flooding = false;
  real_clients.join();
  INFO(ok << " real clients got through; " << failures.size() << " did not, the first: "
          << (failures.empty() ? "" : failures.front()));
  CHECK(failures.empty());
  CHECK(ok > 0);
  require_server_still_serves(f);
}
