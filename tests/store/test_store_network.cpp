// Where the store listens and who gets in: binding, ports, address families, the job
// token, and connect timeouts.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "store/store.h"
#include "core/error.h"
#include "tests/store/store_test_util.h"

using namespace mtrain;
using namespace mtrain::testing;
using Catch::Contains;

namespace {

// An IPv4 address of an interface that is up and not loopback, if the machine has one.
std::optional<std::string> non_loopback_ipv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (ifaddrs* i = list; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    char text[INET_ADDRSTRLEN];
    const auto* in = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text)) found = text;
  }
  ::freeifaddrs(list);
  return found;
}

bool ipv6_loopback_available() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

TEST_CASE("port 0 picks a free port, a different one per server", "[store]") {
  const std::string token = generate_store_token();
  TcpStoreServer a("127.0.0.1", 0, token);
  TcpStoreServer b("127.0.0.1", 0, token);
  CHECK(a.port() != 0);
  CHECK(b.port() != 0);
  CHECK(a.port() != b.port());
  CHECK(a.host() == "127.0.0.1");
  TcpStore client("127.0.0.1", b.port(), token, kTestTimeout, kTestConnectTimeout);
  CHECK(client.port() == b.port());
  client.set("k", std::string("v"));
  CHECK(client.get_string("k") == "v");
}

TEST_CASE("binding a busy port is a CommError naming host:port and the way out", "[store]") {
  const std::string token = generate_store_token();
  TcpStoreServer first("127.0.0.1", 0, token);
  const std::string port = std::to_string(first.port());
  CHECK_THROWS_MATCHES(TcpStoreServer("127.0.0.1", first.port(), token), CommError,
                       Catch::Matchers::Predicate<CommError>([&](const CommError& e) {
                         const std::string m = e.what();
                         return m.find("127.0.0.1:" + port) != std::string::npos &&
                                m.find("already in use") != std::string::npos &&
                                m.find("--master_port 0") != std::string::npos;
                       }));
}

TEST_CASE("bad bind addresses and tokens are clear errors", "[store]") {
  const std::string token = generate_store_token();
  // TEST-NET-3 (RFC 5737): never an address of this machine.
  CHECK_THROWS_WITH(TcpStoreServer("203.0.113.7", 0, token),
                    Contains("203.0.113.7:0") && Contains("address of this machine"));
  CHECK_THROWS_WITH(TcpStoreServer("no-such-host.invalid", 0, token),
                    Contains("cannot resolve") && Contains("no-such-host.invalid"));
  CHECK_THROWS_AS(TcpStoreServer("", 0, token), InvalidArgument);
  CHECK_THROWS_WITH(TcpStoreServer("127.0.0.1", 0, ""), Contains("MTRAIN_STORE_TOKEN"));
  CHECK_THROWS_AS(TcpStoreServer("127.0.0.1", 0, std::string(kMaxTokenBytes + 1, 't')),
                  InvalidArgument);
}

TEST_CASE("a server bound to 127.0.0.1 is not reachable through another local address",
          "[store]") {
  const auto other = non_loopback_ipv4();
  if (!other) {
    WARN("SKIPPED: this machine has no non-loopback IPv4 address to test against");
    return;
  }
  INFO("other local address: " << *other);
  const std::string token = generate_store_token();
  TcpStoreServer loopback_only("127.0.0.1", 0, token);
  RawConnection through_other(loopback_only.port(), other->c_str());
  CHECK(through_other.connect_errno() == ECONNREFUSED);
  CHECK_THROWS_WITH(
      TcpStore(*other, loopback_only.port(), token, kTestTimeout, Millis{200}),
      Contains("could not reach the store at " + *other));
  // Control: the same check passes when the server does listen on that address.
  TcpStoreServer on_other(*other, 0, token);
  RawConnection direct(on_other.port(), other->c_str());
  CHECK(direct.connect_errno() == 0);
  TcpStore client(*other, on_other.port(), token, kTestTimeout, kTestConnectTimeout);
  client.set("k", std::string("v"));
  RawConnection via_loopback(on_other.port());
  CHECK(via_loopback.connect_errno() == ECONNREFUSED);
}

TEST_CASE("IPv6 literals and names resolve", "[store]") {
  const std::string token = generate_store_token();
  SECTION("localhost") {
    TcpStoreServer server("localhost", 0, token);
    TcpStore by_name("localhost", server.port(), token, kTestTimeout, kTestConnectTimeout);
    TcpStore by_v4("127.0.0.1", server.port(), token, kTestTimeout, kTestConnectTimeout);
    by_name.set("k", std::string("v"));
    CHECK(by_v4.get_string("k") == "v");
  }
  SECTION("::1") {
    if (!ipv6_loopback_available()) {
      WARN("SKIPPED: IPv6 loopback is not available here");
      return;
    }
    TcpStoreServer server("::1", 0, token);
    TcpStore client("::1", server.port(), token, kTestTimeout, kTestConnectTimeout);
    client.add("n", 3);
    CHECK(client.get_string("n") == "3");
    // Bound to ::1 only: the IPv4 loopback does not reach it.
    RawConnection v4(server.port());
    CHECK(v4.connect_errno() == ECONNREFUSED);
    CHECK_THROWS_WITH(TcpStoreServer("::1", server.port(), token),
                      Contains("[::1]:" + std::to_string(server.port())));
  }
}

TEST_CASE("connecting where no server listens fails after connect_timeout naming the address",
          "[store]") {
  const uint16_t port = unused_loopback_port();
  const auto start = Clock::now();
  CHECK_THROWS_MATCHES(TcpStore("127.0.0.1", port, "token", kTestTimeout, Millis{300}), CommError,
                       Catch::Matchers::Predicate<CommError>([&](const CommError& e) {
                         const std::string m = e.what();
                         return m.find("could not reach the store at 127.0.0.1:" +
                                       std::to_string(port) + " after 0.3 s") !=
                                    std::string::npos &&
                                m.find("refused") != std::string::npos;
                       }));
  const double elapsed = seconds_since(start);
  CHECK(elapsed >= 0.3);
  CHECK(elapsed < 5.0);
}

TEST_CASE("a client started before its server connects once the server is up", "[store]") {
  const std::string token = generate_store_token();
  const uint16_t port = unused_loopback_port();
  auto client = std::async(std::launch::async, [&] {
    return std::make_unique<TcpStore>("127.0.0.1", port, token, kTestTimeout, Millis{10'000});
  });
  CHECK(client.wait_for(200ms) == std::future_status::timeout);
  TcpStoreServer server("127.0.0.1", port, token);
  auto store = client.get();
  store->set("k", std::string("v"));
  CHECK(store->get_string("k") == "v");
}

TEST_CASE("a wrong or missing token is rejected with a clear message", "[store]") {
  ServerFixture f;
  const std::string where = "127.0.0.1:" + std::to_string(f.server.port());
  const uint64_t before = f.server.rejected_connections();
  // Catch2 v2 combined matchers keep pointers to their parts, so the parts are named.
  const auto names_store = Contains("store at " + where + " rejected the job token");
  const auto names_variable = Contains("check MTRAIN_STORE_TOKEN");
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", f.server.port(), "wrong" + f.token, kTestTimeout,
                             kTestConnectTimeout),
                    names_store && names_variable);
  // Same length, one character off: the comparison is not a prefix check.
  std::string near_miss = f.token;
  near_miss.back() = near_miss.back() == '0' ? '1' : '0';
  CHECK_THROWS_WITH(
      TcpStore("127.0.0.1", f.server.port(), near_miss, kTestTimeout, kTestConnectTimeout),
      names_store && names_variable);
  CHECK_THROWS_WITH(TcpStore("127.0.0.1", f.server.port(), "", kTestTimeout, kTestConnectTimeout),
                    names_store && names_variable);
  CHECK(eventually([&] { return f.server.rejected_connections() == before + 3; }));
  // The wrong tokens learned nothing and stored nothing.
  auto good = f.client();
  CHECK(good->num_keys() == 0);
}

namespace {

// Something that is not an mtrain store on a loopback port: it reads whatever the client
// sends, answers every connection with `reply` and closes.
class FakeServer {
 public:
  explicit FakeServer(Bytes reply) : reply_(std::move(reply)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd_, 8) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      while (true) {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;  // shutdown() below
        uint8_t request[256];
        (void)::recv(c, request, sizeof request, 0);
        (void)::send(c, reply_.data(), reply_.size(), MSG_NOSIGNAL);
        ::close(c);
      }
    });
  }
  ~FakeServer() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  uint16_t port() const { return port_; }

 private:
  Bytes reply_;
  int fd_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
};

}  // namespace

TEST_CASE("a server that is not an mtrain store is not blamed on the token", "[store]") {
  SECTION("an HTTP server") {
    const std::string http = "HTTP/1.0 400 Bad Request\r\n\r\n";
    FakeServer fake(Bytes(http.begin(), http.end()));
    // Catch2 v2 combined matchers keep pointers to their parts, so the parts are named.
    const auto rejected = Contains("rejected the job token");
    const auto not_rejected = !rejected;
    const auto bad_frame = Contains("sent a reply frame of");
    const auto hint = Contains("is something other than an mtrain store listening at 127.0.0.1:" +
                               std::to_string(fake.port()));
    CHECK_THROWS_WITH(TcpStore("127.0.0.1", fake.port(), "token", Millis{2000}, Millis{2000}),
                      bad_frame && hint && not_rejected);
  }
  SECTION("a frame whose status is not OK") {
    // A well-formed one-byte frame with status KEY_MISSING (0x02).
    FakeServer fake(Bytes{1, 0, 0, 0, 2});
    const auto malformed = Contains("malformed reply to the handshake");
    const auto status = Contains("KEY_MISSING");
    CHECK_THROWS_WITH(TcpStore("127.0.0.1", fake.port(), "token", Millis{2000}, Millis{2000}),
                      malformed && status);
  }
}

TEST_CASE("a reconnect inside a call ends by that call's deadline", "[store]") {
  const std::string token = generate_store_token();
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0, token);
  const uint16_t port = server->port();
  TcpStore client("127.0.0.1", port, token, Millis{2000}, Millis{10'000});
  client.set("k", std::string("v"));
  server.reset();
  // The server closed the connection: this call fails and drops it.
  CHECK_THROWS_AS(client.set("k", std::string("v")), CommError);

  // The next call reconnects. Nothing listens for 1 s, then a socket that completes TCP
  // connections but never answers the handshake. The handshake must end at the call's
  // deadline (2 s), not get a fresh 2 s of its own after the reconnect (about 3.3 s).
  auto silent = std::async(std::launch::async, [port] {
    std::this_thread::sleep_for(1000ms);
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool listening = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                           ::listen(fd, 16) == 0;
    return std::make_pair(fd, listening);
  });
  const auto start = Clock::now();
  CHECK_THROWS_WITH(client.set("k", std::string("v")), Contains("did not answer the handshake"));
  const double elapsed = seconds_since(start);
  const auto [fd, listening] = silent.get();
  ::close(fd);
  REQUIRE(listening);
  CHECK(elapsed >= 1.9);
  CHECK(elapsed < 2.8);
}
