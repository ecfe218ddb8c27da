#include "trainer/store_bootstrap.h"

#include <fmt/format.h>

#include "collectives/bootstrap.h"
#include "core/error.h"

namespace mtrain {

std::shared_ptr<Store> open_worker_store(const WorkerEnvironment& env, Millis timeout) {
  switch (env.store_mode) {
    case StoreMode::kNone:
      return nullptr;
    case StoreMode::kLauncher:
      return connect_store_from_env(timeout);
    case StoreMode::kRank0:
    case StoreMode::kMpiBroadcast:
      break;
  }
  throw InvalidArgument(fmt::format("store mode '{}' is not available yet", store_mode_name(env.store_mode)));
}

}  // namespace mtrain
