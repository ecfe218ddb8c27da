#include "core/thread_policy.h"

#include <pthread.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <unistd.h>

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

int own_nice() { return getpriority(PRIO_PROCESS, static_cast<id_t>(gettid())); }

bool set_this_thread_nice(int nice, const char* what) {
  // On Linux the nice value belongs to the thread: PRIO_PROCESS with a thread id.
  if (setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), nice) != 0) {
    spdlog::debug("nice {} for {} refused: {}", nice, what, std::strerror(errno));
    return false;
  }
  return true;
}

}  // namespace mtrain
