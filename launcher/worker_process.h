// One worker process: spawn it in its own process group, signal the group, reap it.
//
// Note [Worker process hygiene]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// * Each worker leads its own process group (setpgid in both parent and child, so the
//   group exists before either side runs on), and every signal goes to the group with
//   killpg: a worker's own children (data-loader processes, `sh -c` pipelines) are
//   stopped with it. A terminal's Ctrl-C reaches only the launcher's group; the
//   launcher forwards it (agent.cpp).
// * In the child, before exec: prctl(PR_SET_PDEATHSIG, SIGKILL), then getppid() is
//   compared with the launcher's pid, because the launcher may have died between fork
//   and prctl (the signal would then never come). PDEATHSIG fires when the *thread*
//   that forked exits, so workers are spawned only from the launcher's main thread,
//   which lives as long as the process. The group's other members are covered by
//   OrphanGuard (orphan_guard.h).
// * Signals are blocked around fork and the child restores default dispositions before
//   unblocking: otherwise a signal landing between fork and exec would run the
//   launcher's handler inside the child and write into the launcher's self-pipe.
// * Standard input is /dev/null. A worker's group is in the background of the launcher's
//   terminal, so a read from the terminal (a debugger prompt, input()) would stop it
//   with SIGTTIN, and a stopped worker is neither running nor reaped: the job would hang
//   without a word. With /dev/null the read returns end-of-file.
// * A failed exec (or CPU binding, --cpu_bind) is reported back through a close-on-exec
//   pipe (which step, errno), so "no such program" is one clear error instead of a worker
//   that exits 127.
// * Workers are reaped by pid (waitpid(pid, WNOHANG)), never waitpid(-1), so the
//   launcher's other children (the orphan guard) are left to their owners.
// * The launcher is a child subreaper (PR_SET_CHILD_SUBREAPER): a worker's children
//   that outlive it are re-parented to the launcher rather than to init (which, in a
//   container, may never reap them). At the end of an attempt each worker's group is
//   SIGKILLed and its members reaped with waitpid(-group), so no zombie is left behind.
//   A descendant that left its group (setsid) is beyond killpg; it is re-parented to
//   init when the launcher exits.
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

// Note [Signalling a reaped worker's group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A process group id stays reserved while any member lives, but once the last member is
// gone the kernel may hand the number to a new process, which may lead a group of its
// own: killpg on a group emptied long ago could hit a stranger. While its leader is not
// reaped the group is surely the worker's. After that, any member left has a parent that
// lives in the group or was re-parented to the launcher (a child subreaper), so the
// group is still the worker's exactly when one of its members is the launcher's child:
// has_child_in_group() looks for one in /proc, and only then is the group signalled.
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

// Resolves the program the way the launcher documents it: "train" -> the sibling
// mtrain-train next to this executable, "bench" -> mtrain-bench, a name with a '/' ->
// that path, anything else -> the first match on PATH. Throws InvalidArgument when the
// result does not exist or is not an executable file.
std::string resolve_program(const std::string& program);

}  // namespace mtrain::launch
