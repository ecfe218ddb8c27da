// How a worker reaches the rendezvous store its launcher hosts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "store/store.h"

namespace mtrain {

// A worker's store and the address it reached it at: backends that open sockets of
// their own listen on the local address that routes there (ProcessGroupOptions::
// rendezvous_host and rendezvous_port).
struct StoreConnection {
  std::shared_ptr<Store> store;
  std::string host;
  uint16_t port = 0;
};

// Connects to the store at MASTER_ADDR:MASTER_PORT with MTRAIN_STORE_TOKEN and scopes
// every key under MTRAIN_STORE_PREFIX when set (mtrain-launch sets a fresh prefix per
// restart attempt, so a restarted gang never sees the previous attempt's keys). The
// returned store owns its connection. Missing or malformed variables are
// InvalidArgument naming the variable; an unreachable store is CommError after
// `timeout`.
StoreConnection connect_store_from_env(Millis timeout = kDefaultStoreTimeout);

}  // namespace mtrain
