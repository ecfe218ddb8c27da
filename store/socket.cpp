#include "store/socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <system_error>

#include "core/error.h"

namespace mtrain::store_socket {

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::vector<SocketAddress> resolve(const std::string& host, uint16_t port) {
  if (host.empty()) throw InvalidArgument("store host is empty; expected an address or a name");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_protocol = IPPROTO_TCP;
  hints.ai_flags = AI_NUMERICSERV;
  // No AI_ADDRCONFIG: it hides ::1 and even 127.0.0.1 on hosts whose only interface is
  // loopback, which is exactly the single-node case.
  addrinfo* list = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
  if (rc != 0) {
    const std::string why = rc == EAI_SYSTEM ? errno_text(errno) : ::gai_strerror(rc);
    // Only a temporary failure (EAI_AGAIN: no answer from the resolver yet) is worth
    // retrying; a name the resolver says does not exist will not start to exist while
    // a worker waits for it, so that is a configuration error, said at once.
    if (rc == EAI_NONAME || rc == EAI_FAIL || rc == EAI_SERVICE) {
      throw InvalidArgument(fmt::format("cannot resolve the store host '{}': {}", host, why));
    }
    throw CommError(fmt::format("cannot resolve the store host '{}': {}", host, why));
  }
  std::vector<SocketAddress> out;
  for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SocketAddress a;
    std::memcpy(&a.storage, ai->ai_addr, ai->ai_addrlen);
    a.length = ai->ai_addrlen;
    const bool duplicate = std::any_of(out.begin(), out.end(), [&](const SocketAddress& b) {
      return b.length == a.length && std::memcmp(&b.storage, &a.storage, a.length) == 0;
    });
    if (!duplicate) out.push_back(a);
  }
  ::freeaddrinfo(list);
  if (out.empty()) {
    throw CommError(fmt::format("the store host '{}' resolved to no TCP address", host));
  }
  return out;
}

std::string endpoint(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

std::string describe(const SocketAddress& address) {
  char host[NI_MAXHOST];
  char service[NI_MAXSERV];
  if (::getnameinfo(address.get(), address.length, host, sizeof host, service, sizeof service,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "<unknown peer>";
  }
  const long port = std::strtol(service, nullptr, 10);
  return endpoint(host, static_cast<uint16_t>(port));
}

std::string errno_text(int err) {
  return fmt::format("{} (errno {})", std::system_category().message(err), err);
}

void set_nonblocking(int fd, const std::string& what) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw CommError(fmt::format("store {}: fcntl(O_NONBLOCK) failed: {}", what, errno_text(errno)));
  }
}

void set_no_delay(int fd, const std::string& what) {
  // Store requests are small request/reply exchanges; Nagle would add up to 40 ms each.
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) {
    throw CommError(
        fmt::format("store {}: setsockopt(TCP_NODELAY) failed: {}", what, errno_text(errno)));
  }
}

int poll_timeout_ms(Clock::time_point deadline) {
  const auto now = Clock::now();
  if (now >= deadline) return 0;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
  return static_cast<int>(std::min<int64_t>(left, INT_MAX));
}

}  // namespace mtrain::store_socket
