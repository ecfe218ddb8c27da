// Small POSIX socket helpers for the store: an owning fd, name resolution, socket
// options and message text. Nothing here knows about the store protocol.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace mtrain::store_socket {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family() const { return storage.ss_family; }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// Every address `host` resolves to for a TCP socket on `port` (IPv4 and IPv6 literals
// and names). Throws CommError naming the host and the resolver's message.
std::vector<SocketAddress> resolve(const std::string& host, uint16_t port);

// "host:port", with IPv6 literals bracketed: "[::1]:29500".
std::string endpoint(const std::string& host, uint16_t port);
// Numeric "address:port" of a socket address (for logs about peers).
std::string describe(const SocketAddress& address);
// strerror text for `err` with its symbolic number, e.g. "Connection refused (errno 111)".
std::string errno_text(int err);

// Each throws CommError naming `what` (the endpoint) when the call fails.
void set_nonblocking(int fd, const std::string& what);
void set_no_delay(int fd, const std::string& what);

// Milliseconds left until `deadline` for poll(): 0 when past, rounded up otherwise.
int poll_timeout_ms(Clock::time_point deadline);

}  // namespace mtrain::store_socket
