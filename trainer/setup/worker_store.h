// Where a distributed worker finds its rendezvous store, whoever started it: the launcher's, one
// rank 0 hosts at an address every rank knows, one whose address rank 0 broadcasts over MPI, or
// none (Note [Who hosts the store] in worker_store.cpp).
#pragma once

#include <memory>
#include <string>

#include "collectives/bootstrap.h"
#include "store/store.h"
#include "trainer/setup/environment.h"

namespace mtrain {

// Connects this worker to its store; on rank 0 in the
// modes that need it, first starts the server, which lives as long as the returned
// store. A null store for StoreMode::kNone. Throws InvalidArgument for a configuration that
// cannot work (e.g. rank 0 asked to bind an address that is not its own, or a store other
// hosts can reach without a secret unless `allow_unauthenticated`: Note [Workers without
// a shared secret] in worker_store.cpp) and CommError when the store cannot be reached
// within `timeout`.
StoreConnection open_worker_store(const WorkerEnvironment& env, bool allow_unauthenticated = false,
                                  Millis timeout = kDefaultStoreTimeout);

}  // namespace mtrain
