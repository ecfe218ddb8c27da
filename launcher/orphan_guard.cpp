#include "launcher/orphan_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "core/error.h"

namespace mtrain::launch {
namespace {

struct Message {
  char op;  // 'w' watch, 'r' release
  pid_t process_group;
};

[[noreturn]] void run_sentinel(int read_fd) {
  setpgid(0, 0);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE}) {
    signal(sig, SIG_IGN);
  }
  // Everything else the launcher had open (its terminal, sockets) is not ours to hold.
  if (read_fd > 3) close_range(3, static_cast<unsigned>(read_fd) - 1, 0);
  close_range(static_cast<unsigned>(read_fd) + 1, ~0U, 0);
  std::set<pid_t> groups;
  Message m{};
  while (true) {
    const ssize_t n = read(read_fd, &m, sizeof(m));
    if (n == static_cast<ssize_t>(sizeof(m))) {
      if (m.op == 'w') groups.insert(m.process_group);
      if (m.op == 'r') groups.erase(m.process_group);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;  // end of file: the launcher is gone
  }
  for (pid_t g : groups) killpg(g, SIGKILL);
  _exit(0);
}

}  // namespace

// Note [Workers die with the launcher]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PR_SET_PDEATHSIG kills each worker when the launcher dies, but not the worker's own
// children, which would become orphans holding memory, ports and GPUs (reference-semantics
// §6). So the launcher forks a sentinel before any thread or worker exists and tells it
// every worker's process group through a pipe whose only write end it holds
// (close-on-exec, so no worker inherits it): when the launcher dies for any reason the
// kernel closes it, and the sentinel SIGKILLs every group it still knows. The sentinel has
// its own process group and ignores the usual termination signals, so a Ctrl-C or
// `kill -- -<launcher pgid>` that takes the launcher does not take the sentinel first.
// After a normal exit every group was released: the sentinel finds nothing to kill.

OrphanGuard::OrphanGuard() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    throw IoError(fmt::format("pipe2 for the orphan guard: {}", std::strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid < 0) {
    throw IoError(fmt::format("fork for the orphan guard: {}", std::strerror(errno)));
  }
  if (pid == 0) {
    close(fds[1]);
    run_sentinel(fds[0]);
  }
  close(fds[0]);
  write_fd_ = fds[1];
  sentinel_ = pid;
}

OrphanGuard::~OrphanGuard() {
  close(write_fd_);
  int status = 0;
  while (waitpid(sentinel_, &status, 0) < 0 && errno == EINTR) {
  }
}

void OrphanGuard::send(char op, pid_t process_group) {
  const Message m{op, process_group};
  // One small write to a pipe is atomic; a failure means the sentinel died, and there
  // is nothing better to do than carry on without it.
  ssize_t n;
  do {
    n = write(write_fd_, &m, sizeof(m));
  } while (n < 0 && errno == EINTR);
}

void OrphanGuard::watch(pid_t process_group) { send('w', process_group); }
void OrphanGuard::release(pid_t process_group) { send('r', process_group); }

}  // namespace mtrain::launch
