#include "store/network_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "core/error.h"

namespace mtrain {

namespace {

std::string numeric_host(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = a.ss_family == AF_INET
                        ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&a)->sin_addr)
                        : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr);
  if (::inet_ntop(a.ss_family, raw, text, sizeof(text)) == nullptr) return {};
  return text;
}

bool is_loopback(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&a)->sin_addr.s_addr) >> 24) == 127;
  }
  const in6_addr& v6 = reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
}

// Whether `host` is this machine's own name (gethostname, with or without the domain).
bool names_this_host(const std::string& host) {
  char own[HOST_NAME_MAX + 1] = {};
  if (::gethostname(own, sizeof own - 1) != 0 || own[0] == '\0') return false;
  const std::string name = own;
  const auto first_label = [](const std::string& n) { return n.substr(0, n.find('.')); };
  return host == name || first_label(host) == first_label(name);
}

// The source address of the route `target` (a numeric address) would take: a UDP
// connect() sends nothing, getsockname() reports the address the kernel picked.
std::optional<sockaddr_storage> routed_source(const sockaddr* target, socklen_t length, std::string& error) {
  const int fd = ::socket(target->sa_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = std::strerror(errno);
    return std::nullopt;
  }
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  const bool ok = ::connect(fd, target, length) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  if (!ok) error = std::strerror(errno);
  ::close(fd);
  return ok ? std::optional(local) : std::nullopt;
}

}  // namespace

std::optional<LocalAddress> interface_address(const std::string& name, std::string* seen) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<LocalAddress> v4, v6;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6)) continue;
    if (seen != nullptr && seen->find(std::string(i->ifa_name) + " ") == std::string::npos) {
      *seen += std::string(i->ifa_name) + " ";
    }
    if (name.empty() ? ((i->ifa_flags & IFF_LOOPBACK) || !(i->ifa_flags & IFF_UP)) : name != i->ifa_name) continue;
    sockaddr_storage a{};
    std::memcpy(&a, i->ifa_addr, i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    if (a.ss_family == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr)) continue;
    auto& slot = a.ss_family == AF_INET ? v4 : v6;
    if (!slot) slot = LocalAddress{numeric_host(a), a.ss_family};
  }
  ::freeifaddrs(list);
  return v4 ? v4 : v6;
}

LocalAddress route_local_address(const std::string& master_host, uint16_t master_port, const std::string& who) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(master_port);
  if (const int rc = ::getaddrinfo(master_host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    throw CommError(fmt::format("{}: cannot resolve the master address {}:{}: {}", who, master_host,
                                master_port, ::gai_strerror(rc)));
  }
  std::string last_error = "no address";
  std::optional<sockaddr_storage> local;
  for (addrinfo* ai = found; ai != nullptr && !local; ai = ai->ai_next) {
    local = routed_source(ai->ai_addr, ai->ai_addrlen, last_error);
  }
  ::freeaddrinfo(found);
  if (!local) {
    throw CommError(fmt::format("{}: no local address routes to the master {}:{} ({})", who,
                                master_host, master_port, last_error));
  }
  // Note [Gloo on the master's own name]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // On the master node, its own name (SLURM's first host, a hostname in MASTER_ADDR)
  // usually resolves to a loopback alias (Debian's 127.0.1.1), so the route to "the
  // master" is loopback, and a device or a store bound there would advertise an address no
  // other node can reach. A name of this host is therefore taken to mean "this host as the
  // others see it": the source address of the default route, else the first interface
  // that is up and not loopback. A loopback literal or "localhost" stays loopback (a
  // one-node job). GLOO_SOCKET_IFNAME, PyTorch's variable, names the interface outright.
  if (is_loopback(*local) && names_this_host(master_host)) {
    sockaddr_in outside{};
    outside.sin_family = AF_INET;
    outside.sin_port = htons(53);
    ::inet_pton(AF_INET, "8.8.8.8", &outside.sin_addr);  // any off-host address; nothing is sent
    std::string ignored;
    if (auto via_default = routed_source(reinterpret_cast<sockaddr*>(&outside), sizeof outside, ignored);
        via_default && !is_loopback(*via_default)) {
      return LocalAddress{numeric_host(*via_default), via_default->ss_family};
    }
    if (auto any = interface_address("", nullptr)) return *any;
  }
  const std::string text = numeric_host(*local);
  if (text.empty()) throw CommError(fmt::format("{}: cannot format the local address reaching {}", who, master_host));
  return LocalAddress{text, local->ss_family};
}

// Note [The store's address]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rank 0's store listens on exactly one address, the one through which this host reaches
// MASTER_ADDR: a loopback MASTER_ADDR keeps the store on loopback (a one-node job: nothing
// outside the host can reach it), an address of this host is itself, and this host's own
// name means its routable address (Note [Gloo on the master's own name]). Every rank on
// rank 0's host connects to that same address, which its own name alone might not reach
// (Debian maps it to 127.0.1.1); ranks on other hosts connect to MASTER_ADDR as given.
std::string store_address_for(const std::string& master_addr, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (::getaddrinfo(master_addr.c_str(), service.c_str(), &hints, &found) != 0) return master_addr;
  bool here = false;
  for (addrinfo* ai = found; ai != nullptr && !here; ai = ai->ai_next) {
    sockaddr_storage target{};
    std::memcpy(&target, ai->ai_addr, ai->ai_addrlen);
    if (is_loopback(target)) {
      here = true;
      break;
    }
    std::string ignored;
    if (auto source = routed_source(ai->ai_addr, ai->ai_addrlen, ignored)) {
      here = numeric_host(*source) == numeric_host(target);
    }
  }
  ::freeaddrinfo(found);
  return here ? route_local_address(master_addr, port, "the rendezvous store").ip : master_addr;
}

}  // namespace mtrain
