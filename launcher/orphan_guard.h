// OrphanGuard: a tiny sentinel process that SIGKILLs every registered worker process
// group, children included, when the launcher dies without cleaning up (SIGKILL, OOM
// kill, crash) (Note [Workers die with the launcher] in orphan_guard.cpp).
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
