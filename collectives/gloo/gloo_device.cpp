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
  return route_local_address(master_host, master_port, "gloo");
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
