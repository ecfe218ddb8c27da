#include "collectives/gloo/gloo_device.h"

#include <arpa/inet.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace mtrain {

LocalAddress local_address_reaching(const std::string& master_host, uint16_t master_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(master_port);
  if (const int rc = ::getaddrinfo(master_host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    throw CommError(fmt::format("gloo: cannot resolve the master address {}:{}: {}", master_host,
                                master_port, ::gai_strerror(rc)));
  }
  std::string last_error = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    ::close(fd);
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw = local.ss_family == AF_INET
                          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                          : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    if (::inet_ntop(local.ss_family, raw, text, sizeof(text)) == nullptr) {
      last_error = std::strerror(errno);
      continue;
    }
    ::freeaddrinfo(found);
    return LocalAddress{text, local.ss_family};
  }
  ::freeaddrinfo(found);
  throw CommError(fmt::format("gloo: no local address routes to the master {}:{} ({})",
                              master_host, master_port, last_error));
}

std::shared_ptr<gloo::transport::Device> create_tcp_device(const LocalAddress& address) {
  gloo::transport::tcp::attr attr;
  attr.hostname = address.ip;
  attr.ai_family = address.family;
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("gloo: cannot create a TCP device on {}: {}", address.ip, e.what()));
  }
}

}  // namespace mtrain
