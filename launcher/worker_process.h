// One worker process: spawn it in its own process group, signal the group, reap it.
// A worker dies with the launcher, reads end-of-file from standard input, and one that
// cannot be started is an IoError from spawn(), not a worker that exits 127
// (Note [Worker process hygiene] in worker_process.cpp).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace mtrain::launch {

using WallClock = std::chrono::system_clock;

// How a process ended.
struct ExitStatus {
  bool signaled = false;
  int code = 0;    // exit code when !signaled
  int signal = 0;  // terminating signal when signaled

  static ExitStatus from_wait_status(int status);
  bool success() const { return !signaled && code == 0; }
  // What a shell would report: the exit code, or 128 + signal.
  int shell_status() const { return signaled ? 128 + signal : code; }
  // "exit code 3" or "signal 9 (SIGKILL)".
  std::string describe() const;
};

// "SIGKILL" for 9; "signal 77" for unknown numbers.
std::string signal_name(int sig);

struct WorkerSpec {
  std::string executable;                // resolved path handed to execve
  std::vector<std::string> argv;         // argv[0] as the user wrote it
  std::vector<std::string> environment;  // complete "KEY=VALUE" list
  int stdout_fd = -1;                    // dup2'd onto 1 in the child; -1 = inherit
  int stderr_fd = -1;                    // dup2'd onto 2 in the child; -1 = inherit
  std::vector<int> cpus;                 // CPU affinity set in the child; empty = inherit
};

bool has_child_in_group(pid_t pgid);

class WorkerProcess {
 public:
  // Forks and execs `spec`. Throws IoError naming the executable when exec fails.
  // Call only from the main thread (Note [Worker process hygiene]).
  static WorkerProcess spawn(const WorkerSpec& spec);

  pid_t pid() const { return pid_; }  // also the process group id
  bool running() const { return !status_.has_value(); }
  const std::optional<ExitStatus>& status() const { return status_; }
  WallClock::time_point exit_time() const { return exit_time_; }

  // Sends `sig` to the worker's whole process group. Harmless when the group is gone.
  // After the worker was reaped, only while a child of the launcher is still in it
  // (Note [Signalling a reaped worker's group]).
  void signal_group(int sig) const;
  // True while the worker itself is stopped by a signal (SIGSTOP, SIGTSTP, ...; state T in
  // /proc/<pid>/stat), not when traced. False once reaped or when that cannot be read.
  bool stopped() const;
  // Reaps the worker if it has exited (never blocks); true when it exited just now.
  bool try_reap();
  // After the worker was reaped: SIGKILLs whatever is left of its process group and
  // reaps those members that became the launcher's children (it is a child subreaper,
  // Note [Worker process hygiene]), waiting at most `budget` for them to die.
  void kill_and_reap_group(std::chrono::milliseconds budget) const;

 private:
  explicit WorkerProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
  std::optional<ExitStatus> status_;
  WallClock::time_point exit_time_{};
};


}  // namespace mtrain::launch
