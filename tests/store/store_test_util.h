// Helpers for the store tests: a server on a free loopback port, clients with short
// timeouts, and a raw socket that speaks (or breaks) the wire protocol by hand.
#pragma once

#include <arpa/inet.h>
#include <catch2/catch.hpp>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "store/store.h"
#include "store/wire.h"
#include "core/error.h"

namespace mtrain::testing {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

inline constexpr Millis kTestTimeout{10'000};
inline constexpr Millis kTestConnectTimeout{5'000};

struct ServerFixture {
  std::string token = generate_store_token();
  TcpStoreServer server{"127.0.0.1", 0, token};

  std::unique_ptr<TcpStore> client(Millis timeout = kTestTimeout) {
    return std::make_unique<TcpStore>("127.0.0.1", server.port(), token, timeout,
                                      kTestConnectTimeout);
  }
};

// Polls `condition` until it holds or `limit` passes; returns its last value.
inline bool eventually(const std::function<bool()>& condition, Millis limit = 3000ms) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return condition();
}

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A plain blocking TCP connection to 127.0.0.1:port.
class RawConnection {
 public:
  explicit RawConnection(uint16_t port, const char* address = "127.0.0.1") {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    REQUIRE(::inet_pton(AF_INET, address, &a.sin_addr) == 1);
    connect_errno_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
  }
  ~RawConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  int connect_errno() const { return connect_errno_; }

  // Best effort: the server may already have closed (that is what some tests expect).
  void send(const Bytes& data) {
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::send(fd_, data.data() + done, data.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return;
      done += static_cast<size_t>(n);
    }
  }

  // One reply frame's payload, or nullopt on close or after `limit`.
  std::optional<Bytes> read_frame(Millis limit = 3000ms) {
    uint8_t prefix[4];
    if (!read_exact(prefix, 4, limit)) return std::nullopt;
    Bytes payload(store_wire::load_u32_le(prefix));
    if (!read_exact(payload.data(), payload.size(), limit)) return std::nullopt;
    return payload;
  }

  // Sends the HELLO handshake and requires the OK reply.
  void authenticate(const std::string& token) {
    send(store_wire::FrameWriter()
             .op(store_wire::Opcode::kHello)
             .u32(store_wire::kHelloMagic)
             .u32(store_wire::kProtocolVersion)
             .bytes(token)
             .finish());
    const auto reply = read_frame();
    REQUIRE(reply.has_value());
    REQUIRE(reply->size() == 1);
    REQUIRE((*reply)[0] == static_cast<uint8_t>(store_wire::Status::kOk));
  }

  // True when the peer closes (EOF or reset) within `limit`; data read is discarded.
  bool closed_by_peer_within(Millis limit) {
    const auto deadline = Clock::now() + limit;
    uint8_t buf[4096];
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
      if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left, 1))) <= 0) continue;
      const ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
      if (n == 0) return true;
      if (n < 0 && errno != EAGAIN && errno != EINTR) return true;
    }
    return false;
  }

 private:
  bool read_exact(uint8_t* data, size_t size, Millis limit) {
    const auto deadline = Clock::now() + limit;
    size_t done = 0;
    while (done < size) {
      pollfd p{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
      const ssize_t n = ::recv(fd_, data + done, size - done, 0);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  int fd_ = -1;
  int connect_errno_ = 0;
};

// A port on which nothing listens right now (bound, read back, released).
inline uint16_t unused_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace mtrain::testing
