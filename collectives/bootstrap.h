// How a worker reaches the rendezvous store its launcher hosts.
#pragma once

#include <memory>

#include "collectives/store.h"

namespace mtrain {

// Connects to the store at MASTER_ADDR:MASTER_PORT with MTRAIN_STORE_TOKEN and scopes
// every key under MTRAIN_STORE_PREFIX when set (mtrain-launch sets a fresh prefix per
// restart attempt, so a restarted gang never sees the previous attempt's keys). The
// returned store owns its connection. Missing or malformed variables are
// InvalidArgument naming the variable; an unreachable store is CommError after
// `timeout`.
std::shared_ptr<Store> connect_store_from_env(Millis timeout = kDefaultStoreTimeout);

}  // namespace mtrain
