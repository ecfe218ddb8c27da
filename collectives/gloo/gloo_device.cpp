#include "collectives/gloo/gloo_device.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <optional>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/thread_policy.h"

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

// An address of interface `name`, or (name empty) of any interface that is up and not
// loopback; IPv4 first, never an IPv6 link-local one (it would need a scope).
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

}  // namespace

LocalAddress local_address_reaching(const std::string& master_host, uint16_t master_port) {
  if (const auto ifname = env::get("GLOO_SOCKET_IFNAME"); ifname && !ifname->empty()) {
    const std::string first = ifname->substr(0, ifname->find(','));
    std::string seen;
    if (auto a = interface_address(first, &seen)) return *a;
    if ((" " + seen).find(" " + first + " ") != std::string::npos) {
      throw InvalidArgument(fmt::format(
          "environment variable GLOO_SOCKET_IFNAME={}: interface '{}' has only link-local IPv6 addresses, which "
          "other hosts cannot be told without a scope; give it an IPv4 or a global IPv6 address, or name another",
          *ifname, first));
    }
    throw InvalidArgument(fmt::format(
        "environment variable GLOO_SOCKET_IFNAME={}: expected an interface of this host with an IPv4 or IPv6 "
        "address, found none named '{}' (interfaces with addresses: {})",
        *ifname, first, seen.empty() ? "none" : seen.substr(0, seen.size() - 1)));
  }
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
  std::optional<sockaddr_storage> local;
  for (addrinfo* ai = found; ai != nullptr && !local; ai = ai->ai_next) {
    local = routed_source(ai->ai_addr, ai->ai_addrlen, last_error);
  }
  ::freeaddrinfo(found);
  if (!local) {
    throw CommError(fmt::format("gloo: no local address routes to the master {}:{} ({})",
                                master_host, master_port, last_error));
  }
  // Note [Gloo on the master's own name]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // On the master node, its own name (SLURM's first host, a hostname in MASTER_ADDR)
  // usually resolves to a loopback alias (Debian's 127.0.1.1), so the route to "the
  // master" is loopback, and a device bound there would advertise an address no other
  // node can reach. A name of this host is therefore taken to mean "this host as the
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
  if (text.empty()) throw CommError(fmt::format("gloo: cannot format the local address reaching {}", master_host));
  return LocalAddress{text, local->ss_family};
}

// Note [Gloo event-loop priority]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A Gloo TCP device runs one event-loop thread (epoll, level-triggered) that reads
// and writes every pair's socket. When data is waiting on a socket, the loop calls
// the pair's handler, which only try-locks the pair's mutex; if another thread holds
// it (the thread running a collective, posting a send or receive), the handler
// returns without reading, epoll reports the same data at once, and the loop spins.
// With a free core that lasts microseconds. With every core busy, which is the normal
// state of data-parallel training with one rank per core, the loop has usually just
// preempted the lock holder on its own core (a thread woken by I/O runs first), and it
// spins until the scheduler takes the core back from it, up to a few milliseconds.
// Measured with 2 LeNet ranks on the 2-core CI VM: 45,000 futile loop iterations per
// second, about 3 ms added to half of the gradient all-reduces, and 2-rank throughput
// of 28-29k img/s.
//
// So the loop thread ran under SCHED_IDLE: the scheduler gives it a core that
// nothing else wants at once, and when it competes it yields to any normal thread,
// the lock holder included (the same runs: 3,000 futile iterations per second, 34-36k
// img/s; nice 19 instead gave 33-34k; ResNet-18, whose all-reduces overlap backward,
// measured the same either way). A rank that waits for a collective sleeps, which
// frees its core for the loop.
//
// But only if nothing else wants that core. Any other process at normal priority (a
// compiler, a data-preparation job, a monitoring agent) takes it instead, and a
// SCHED_IDLE loop then moves the gradients only when that process pauses. On the
// 2-core VM with a build beside it, or with two busy shell loops, 2-rank LeNet fell to
// 1.5-1.6k img/s with 77-83 % of the step waiting for gradients, against 6.9-8.5k at
// normal priority. So the loop now runs at nice 10 (kGlooLoopNice):
// the scheduler favours the training threads (a weight of 110 against their 1024)
// but no longer leaves the loop waiting behind every other program. Alternating
// 60-step 2-rank LeNet runs on the same VM (img/s, two or three rounds):
//
//   loop          | idle machine  | two busy shell loops beside
//   SCHED_IDLE    | 12.8k-13.8k   | 1.5k-1.6k
//   nice 10       | 11.6k-13.5k   | 5.6k-7.0k
//   nice 19       | 13.3k-13.4k   | 4.5k-6.5k
//   normal        | 10.7k-13.3k   | 7.6k-8.5k
//
// (docs/benchmarks.md has the command; on the idle machine the four are within the
// run-to-run spread.)
//
// The thread inherits policy and nice value from the thread that creates the device,
// so a short-lived helper thread takes them and creates it; the caller's scheduling is
// untouched. MTRAIN_GLOO_LOOP_SCHED=idle or =normal chooses the other two.
LoopScheduling loop_scheduling_from_env() {
  const std::string choice = env::get_choice("MTRAIN_GLOO_LOOP_SCHED", {"nice", "idle", "normal"});
  return choice == "idle" ? LoopScheduling::Idle : choice == "normal" ? LoopScheduling::Normal : LoopScheduling::Nice;
}

std::shared_ptr<gloo::transport::Device> create_tcp_device(const LocalAddress& address,
                                                           LoopScheduling loop) {
  gloo::transport::tcp::attr attr;
  attr.hostname = address.ip;
  attr.ai_family = address.family;
  std::shared_ptr<gloo::transport::Device> device;
  std::exception_ptr error;
  auto create = [&] {
    try {
      device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(CommError(
          fmt::format("gloo: cannot create a TCP device on {}: {}", address.ip, e.what())));
    }
  };
  if (loop == LoopScheduling::Normal) {
    create();
  } else {
    std::thread helper([&] {
      // If refused, the loop runs at normal priority, as Gloo made it.
      if (loop == LoopScheduling::Idle) {
        set_this_thread_policy(SCHED_IDLE, "gloo's event-loop thread");
      } else if (own_nice() < kGlooLoopNice) {  // a process niced further stays so
        set_this_thread_nice(kGlooLoopNice, "gloo's event-loop thread");
      }
      create();
    });
    helper.join();
  }
  if (error) std::rethrow_exception(error);
  return device;
}

}  // namespace mtrain
