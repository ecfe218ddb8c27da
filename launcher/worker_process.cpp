#include "launcher/worker_process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/env.h"
#include "core/error.h"
#include "launcher/cpu_binding.h"

namespace mtrain::launch {
namespace {

// Exit code of a child whose exec failed (what shells use for "cannot execute").
constexpr int kExecFailedCode = 127;

std::vector<char*> as_c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// What the child reports through its close-on-exec pipe when it cannot become the
// worker: the step that failed and its errno.
struct SpawnFailure {
  enum Step : int { kExec, kAffinity, kProcessGroup, kDeathSignal, kSignalMask, kRedirect } step = kExec;
  int error = 0;
};

[[noreturn]] void report_and_exit(int report_fd, SpawnFailure::Step step, int error) {
  const SpawnFailure failure{step, error};
  ssize_t ignored = write(report_fd, &failure, sizeof(failure));
  (void)ignored;
  _exit(kExecFailedCode);
}

// Runs in the forked child: async-signal-safe calls only (the launcher has threads).
[[noreturn]] void exec_child(const char* path, char* const* argv, char* const* envp,
                             int stdout_fd, int stderr_fd, const cpu_set_t* cpus,
                             pid_t launcher_pid, int report_fd) {
  if (setpgid(0, 0) != 0) report_and_exit(report_fd, SpawnFailure::kProcessGroup, errno);
  // Default dispositions before unblocking (Note [Worker process hygiene]); exec keeps
  // SIG_IGN, so the launcher's ignored SIGPIPE must not leak into the worker either.
  // Unchecked on purpose: the C library reserves a few real-time signals, which refuse.
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) signal(sig, SIG_DFL);
  }
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) report_and_exit(report_fd, SpawnFailure::kDeathSignal, errno);
  if (getppid() != launcher_pid) _exit(kExecFailedCode);  // the launcher is already gone
  // Before exec, so every thread the worker starts inherits it.
  if (cpus != nullptr && sched_setaffinity(0, sizeof(*cpus), cpus) != 0) {
    report_and_exit(report_fd, SpawnFailure::kAffinity, errno);
  }
  sigset_t none;
  sigemptyset(&none);
  if (sigprocmask(SIG_SETMASK, &none, nullptr) != 0) report_and_exit(report_fd, SpawnFailure::kSignalMask, errno);
  if (stdout_fd >= 0 && dup2(stdout_fd, STDOUT_FILENO) < 0) report_and_exit(report_fd, SpawnFailure::kRedirect, errno);
  if (stderr_fd >= 0 && dup2(stderr_fd, STDERR_FILENO) < 0) report_and_exit(report_fd, SpawnFailure::kRedirect, errno);
  const int no_input = open("/dev/null", O_RDONLY);  // Note [Worker process hygiene]
  if (no_input < 0) report_and_exit(report_fd, SpawnFailure::kRedirect, errno);
  if (no_input != STDIN_FILENO) {
    if (dup2(no_input, STDIN_FILENO) < 0) report_and_exit(report_fd, SpawnFailure::kRedirect, errno);
    close(no_input);
  }
  execve(path, argv, envp);
  report_and_exit(report_fd, SpawnFailure::kExec, errno);
}

}  // namespace

ExitStatus ExitStatus::from_wait_status(int status) {
  ExitStatus s;
  if (WIFSIGNALED(status)) {
    s.signaled = true;
    s.signal = WTERMSIG(status);
  } else {
    s.code = WEXITSTATUS(status);
  }
  return s;
}

std::string ExitStatus::describe() const {
  if (signaled) return fmt::format("signal {} ({})", signal, signal_name(signal));
  return fmt::format("exit code {}", code);
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  if (abbrev == nullptr) return fmt::format("signal {}", sig);
  return fmt::format("SIG{}", abbrev);
}

// Note [Worker process hygiene]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// * Each worker leads its own process group (setpgid in parent and child, so the group
//   exists before either runs on) and every signal goes to the group: a worker's own
//   children (data-loader processes, `sh -c` pipelines) stop with it. A terminal's Ctrl-C
//   reaches only the launcher's group, which forwards it.
// * The child sets PR_SET_PDEATHSIG, then compares getppid() with the launcher's pid: the
//   launcher may have died before prctl, and the signal would never come. PDEATHSIG fires
//   when the *thread* that forked exits, so workers are spawned only from the main thread.
//   OrphanGuard covers the group's other members.
// * Signals are blocked around fork and reset to their defaults in the child before it
//   unblocks them: a signal between fork and exec would otherwise run the launcher's
//   handler in the child and write into the launcher's self-pipe.
// * Standard input is /dev/null. The worker's group is in the background of the
//   launcher's terminal, so a read from it (a debugger prompt, input()) would stop the
//   worker with SIGTTIN, neither running nor reaped, and the job would hang without a word.
// * A failed exec (or CPU binding) comes back through a close-on-exec pipe (which step,
//   errno): one clear error instead of a worker that exits 127.
// * Workers are reaped by pid, never with waitpid(-1), which would reap the orphan guard.
// * The launcher is a child subreaper: a worker's children that outlive it come to the
//   launcher rather than to init (which, in a container, may never reap them), and at the
//   end of an attempt each worker's group is SIGKILLed and reaped. A descendant that left
//   its group (setsid) is beyond killpg; it goes to init when the launcher exits.

WorkerProcess WorkerProcess::spawn(const WorkerSpec& spec) {
  // Everything the child needs is built before fork: it may not allocate.
  std::vector<char*> argv = as_c_strings(spec.argv);
  std::vector<char*> envp = as_c_strings(spec.environment);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  for (int cpu : spec.cpus) {
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
      throw InvalidArgument(fmt::format("CPU {} is outside 0..{}", cpu, CPU_SETSIZE - 1));
    }
    CPU_SET(cpu, &cpus);
  }

  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    throw IoError(fmt::format("pipe2 for spawning {}: {}", spec.executable, std::strerror(errno)));
  }
  sigset_t all;
  sigset_t previous;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous);
  const pid_t launcher_pid = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    close(report[0]);
    exec_child(spec.executable.c_str(), argv.data(), envp.data(), spec.stdout_fd,
               spec.stderr_fd, spec.cpus.empty() ? nullptr : &cpus, launcher_pid, report[1]);
  }
  const int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  close(report[1]);
  if (pid < 0) {
    close(report[0]);
    throw IoError(fmt::format("fork for {}: {}", spec.executable, std::strerror(fork_errno)));
  }
  setpgid(pid, pid);  // also here: the group must exist before we signal it

  SpawnFailure failure;
  ssize_t n;
  do {
    n = read(report[0], &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n == static_cast<ssize_t>(sizeof(failure))) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    const char* reason = std::strerror(failure.error);
    if (failure.step == SpawnFailure::kAffinity) {
      throw IoError(fmt::format("cannot bind a worker of '{}' to CPUs {}: {}", spec.executable,
                                format_cpu_list(spec.cpus), reason));
    }
    const char* step = nullptr;  // what the child could not do before exec
    switch (failure.step) {
      case SpawnFailure::kProcessGroup: step = "give it a process group of its own (setpgid)"; break;
      case SpawnFailure::kDeathSignal: step = "tie it to the launcher's life (prctl PR_SET_PDEATHSIG)"; break;
      case SpawnFailure::kSignalMask: step = "clear its signal mask (sigprocmask)"; break;
      case SpawnFailure::kRedirect: step = "connect it to its output files and /dev/null (dup2)"; break;
      case SpawnFailure::kAffinity:
      case SpawnFailure::kExec: break;
    }
    if (step != nullptr) {
      throw IoError(fmt::format("cannot start a worker of '{}': could not {}: {}", spec.executable, step, reason));
    }
    throw IoError(fmt::format("cannot execute '{}': {}", spec.executable, reason));
  }
  return WorkerProcess(pid);
}

// Note [Signalling a reaped worker's group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A process group id stays reserved while any member lives, but once the last member is
// gone the kernel may hand the number to a new process, which may lead a group of its
// own: killpg on a group emptied long ago could hit a stranger. While its leader is not
// reaped the group is surely the worker's. After that, any member left has a parent that
// lives in the group or was re-parented to the launcher (a child subreaper), so the
// group is still the worker's exactly when one of its members is the launcher's child:
// has_child_in_group() looks for one in /proc, and only then is the group signalled.

bool has_child_in_group(pid_t pgid) {
  const pid_t self = ::getpid();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "stat");
    std::string stat;
    if (!std::getline(in, stat)) continue;  // gone meanwhile
    // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    char state = 0;
    long ppid = 0, pgrp = 0;
    if (rest >> state >> ppid >> pgrp && ppid == self && pgrp == pgid) return true;
  }
  return false;
}

void WorkerProcess::signal_group(int sig) const {
  // ESRCH (the whole group is gone) is the normal end state, not an error.
  if (status_ && !has_child_in_group(pid_)) return;  // Note [Signalling a reaped worker's group]
  ::killpg(pid_, sig);
}

bool WorkerProcess::stopped() const {
  if (status_) return false;
  std::ifstream in(fmt::format("/proc/{}/stat", pid_));
  std::string stat((std::istreambuf_iterator<char>(in)), {});
  // "pid (comm) state ...": comm may hold spaces and parentheses, so from the last ')'.
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'T';
}

bool WorkerProcess::try_reap() {
  if (status_) return false;
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid_, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r != pid_) return false;
  status_ = ExitStatus::from_wait_status(status);
  exit_time_ = WallClock::now();
  return true;
}

void WorkerProcess::kill_and_reap_group(std::chrono::milliseconds budget) const {
  signal_group(SIGKILL);
  const auto deadline = std::chrono::steady_clock::now() + budget;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(-pid_, &status, WNOHANG);
    if (r > 0) continue;                      // reaped one; look for more
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return;                        // ECHILD: none of the group is our child
    if (std::chrono::steady_clock::now() >= deadline) return;
    usleep(1000);                             // members still dying
  }
}

}  // namespace mtrain::launch
