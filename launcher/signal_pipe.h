// The launcher's signals, turned into bytes on a pipe that the supervision loop polls.
//
// Note [Launcher signals]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A self-pipe rather than signalfd: signalfd only sees signals blocked in every thread,
// and the store library starts threads of its own. The handler writes the signal number
// (one byte, async-signal-safe) and poll() on the read end wakes the loop at once, so a
// worker's exit (SIGCHLD) is noticed immediately, not at the next monitor tick.
//   SIGCHLD                          wake up and reap
//   SIGUSR1, SIGUSR2                 forwarded to every worker's process group (SLURM
//                                    sends these before preemption); supervision goes on.
//                                    mtrain-train stops after its current step on SIGUSR1
//                                    (Note [Workers stopped on a signal] in
//                                    failure_report.h says what the launcher does then)
//   SIGINT, SIGTERM, SIGHUP, SIGQUIT forwarded, then the gang is stopped as after a
//                                    failure (grace, SIGKILL); the launcher exits with
//                                    128 + signal and does not restart, or with 75 when
//                                    every worker stopped cleanly after a step (mtrain-train
//                                    does on SIGINT and SIGTERM). The same signal a second
//                                    time (a second Ctrl-C) SIGKILLs at once.
// SIGPIPE is ignored: a closed console or socket must not kill the supervisor.
#pragma once

#include <vector>

namespace mtrain::launch {

class SignalPipe {
 public:
  // Installs the handlers (once per process) and returns the pipe.
  static SignalPipe& install();

  int read_fd() const { return read_fd_; }
  // Signals received since the last call, in arrival order (never blocks).
  std::vector<int> drain();

  static bool is_terminating(int sig);
  static bool is_forwarded_only(int sig);

 private:
  SignalPipe();
  int read_fd_ = -1;
};

}  // namespace mtrain::launch
