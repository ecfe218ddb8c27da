// The launcher's signals, turned into bytes on a pipe that the supervision loop polls,
// so that a signal wakes it at once (Note [Launcher signals] in signal_pipe.cpp):
//   SIGCHLD                           a worker ended: reap it
//   SIGUSR1, SIGUSR2                  is_forwarded_only(): passed on to the workers,
//                                     supervision goes on
//   SIGINT, SIGTERM, SIGHUP, SIGQUIT  is_terminating(): the gang is stopped and the job
//                                     ends (docs/launcher.md, "Signals")
// SIGPIPE is ignored. --signals_to_handle chooses which of the last six are caught.
#pragma once

#include <set>
#include <vector>

namespace mtrain::launch {

class SignalPipe {
 public:
  // Installs the handlers for SIGCHLD and `handled` (a subset of SIGINT, SIGTERM,
  // SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2; the others keep their default action) once per
  // process, and returns the pipe. A later call returns the same pipe.
  static SignalPipe& install(const std::set<int>& handled);

  int read_fd() const { return read_fd_; }
  // Signals received since the last call, in arrival order (never blocks).
  std::vector<int> drain();

  static bool is_terminating(int sig);
  static bool is_forwarded_only(int sig);

 private:
  explicit SignalPipe(const std::set<int>& handled);
  int read_fd_ = -1;
};

}  // namespace mtrain::launch
