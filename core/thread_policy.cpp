#include "core/thread_policy.h"

#include <pthread.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

namespace mtrain {

bool set_this_thread_policy(int policy, const char* what) {
  sched_param param{};
  if (const int rc = pthread_setschedparam(pthread_self(), policy, &param); rc != 0) {
    spdlog::debug("scheduling policy {} for {} refused: {}", policy, what, std::strerror(rc));
    return false;
  }
  return true;
}

// On Linux the nice value belongs to the thread, and PRIO_PROCESS with who = 0 means
// the calling thread.
int own_nice() {
  errno = 0;
  const int nice = getpriority(PRIO_PROCESS, 0);
  return errno == 0 ? nice : 0;  // -1 is a valid nice value; an error reads as 0
}

bool set_this_thread_nice(int nice, const char* what) {
  if (setpriority(PRIO_PROCESS, 0, nice) != 0) {
    spdlog::debug("nice {} for {} refused: {}", nice, what, std::strerror(errno));
    return false;
  }
  return true;
}

}  // namespace mtrain
