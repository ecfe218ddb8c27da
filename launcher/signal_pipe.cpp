#include "launcher/signal_pipe.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace mtrain::launch {
namespace {

int g_write_fd = -1;

void on_signal(int sig) {
  const int saved = errno;
  const auto byte = static_cast<unsigned char>(sig);
  // A full pipe drops the byte; the loop also polls on a timeout, and SIGCHLD is only
  // a wake-up (reaping uses waitpid), so nothing is lost that matters.
  ssize_t ignored = ::write(g_write_fd, &byte, 1);
  (void)ignored;
  errno = saved;
}


}  // namespace

// Note [Launcher signals]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A self-pipe rather than signalfd: signalfd only sees signals blocked in every thread,
// and the store library starts threads of its own. The handler writes the signal number
// (one byte, async-signal-safe), so poll() on the read end wakes the supervision loop at
// once: a worker's exit (SIGCHLD) is noticed immediately, not at the next monitor tick.
// SIGPIPE is ignored: a closed console or socket must not kill the supervisor.

SignalPipe::SignalPipe(const std::set<int>& handled) {
  for (int sig : handled) {
    MTRAIN_CHECK(is_terminating(sig) || is_forwarded_only(sig), "signal {} cannot be handled", sig);
  }
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw IoError(fmt::format("pipe2 for signal handling: {}", std::strerror(errno)));
  }
  read_fd_ = fds[0];
  g_write_fd = fds[1];
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  std::set<int> all = handled;
  all.insert(SIGCHLD);
  for (int sig : all) {
    if (sigaction(sig, &sa, nullptr) != 0) {
      throw IoError(fmt::format("sigaction for signal {}: {}", sig, std::strerror(errno)));
    }
  }
  if (signal(SIGPIPE, SIG_IGN) == SIG_ERR) {
    throw IoError(fmt::format("ignoring SIGPIPE: {}", std::strerror(errno)));
  }
}

SignalPipe& SignalPipe::install(const std::set<int>& handled) {
  static SignalPipe pipe(handled);
  return pipe;
}

std::vector<int> SignalPipe::drain() {
  std::vector<int> out;
  unsigned char buf[64];
  while (true) {
    const ssize_t n = ::read(read_fd_, buf, sizeof(buf));
    if (n > 0) {
      out.insert(out.end(), buf, buf + n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return out;
  }
}

bool SignalPipe::is_terminating(int sig) {
  return sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT;
}

bool SignalPipe::is_forwarded_only(int sig) { return sig == SIGUSR1 || sig == SIGUSR2; }

}  // namespace mtrain::launch
