// OrphanGuard: a tiny sentinel process that kills the workers' process groups when the
// launcher dies without cleaning up (SIGKILL, OOM kill, crash).
//
// Note [Workers die with the launcher]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PR_SET_PDEATHSIG (worker_process.cpp) kills each worker when the launcher dies, but
// not the worker's own children, which would become orphans holding memory, ports and
// GPUs (the zombie complaints of reference-semantics §6). So the launcher forks a
// sentinel first, before any thread or worker exists, and tells it the process group
// of every worker through a pipe. The launcher holds the only write end (close-on-exec,
// so no worker inherits it across exec); when the launcher dies for any reason the
// kernel closes it, the sentinel reads end-of-file and SIGKILLs every group it still
// knows. The sentinel sits in its own process group and ignores the usual termination
// signals, so a Ctrl-C or `kill -- -<launcher pgid>` that takes the launcher does not
// take the sentinel before it has done its job. On a normal exit the launcher has
// already reaped its workers and released their groups, so the sentinel finds nothing
// left to kill.
#pragma once

#include <sys/types.h>

namespace mtrain::launch {

class OrphanGuard {
 public:
  // Forks the sentinel. Call before starting any thread.
  OrphanGuard();
  // Closes the pipe (the sentinel kills what is still registered) and reaps the sentinel.
  ~OrphanGuard();
  OrphanGuard(const OrphanGuard&) = delete;
  OrphanGuard& operator=(const OrphanGuard&) = delete;

  void watch(pid_t process_group);
  void release(pid_t process_group);

 private:
  void send(char op, pid_t process_group);
  int write_fd_ = -1;
  pid_t sentinel_ = -1;
};

}  // namespace mtrain::launch
