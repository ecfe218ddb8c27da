#include "core/thread_policy.h"

#include <pthread.h>
#include <sched.h>
#include <spdlog/spdlog.h>

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

}  // namespace mtrain
