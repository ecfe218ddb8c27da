#include "collectives/gloo/gloo_device.h"

#include <arpa/inet.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/thread_policy.h"

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
// So the loop thread runs under SCHED_IDLE: the scheduler gives it a core that
// nothing else wants at once, and when it competes it yields to any normal thread,
// the lock holder included (the same runs: 3,000 futile iterations per second, 34-36k
// img/s; nice 19 instead gave 33-34k; ResNet-18, whose all-reduces overlap backward,
// measured the same either way). Its work is never lost: a rank that waits for a
// collective sleeps, which frees its core for the loop. The thread inherits the
// policy from the thread that creates the device, so a short-lived helper thread
// takes SCHED_IDLE and creates it; the caller's scheduling is untouched.
// MTRAIN_GLOO_LOOP_SCHED=normal keeps the loop at normal priority.
LoopScheduling loop_scheduling_from_env() {
  return env::get_choice("MTRAIN_GLOO_LOOP_SCHED", {"idle", "normal"}) == "idle" ? LoopScheduling::Idle
                                                                                : LoopScheduling::Normal;
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
      set_this_thread_policy(SCHED_IDLE, "gloo's event-loop thread");
      create();
    });
    helper.join();
  }
  if (error) std::rethrow_exception(error);
  return device;
}

}  // namespace mtrain
