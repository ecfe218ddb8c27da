// The Gloo backend: CPU collectives over TCP, bootstrapped through the mtrain store (Note [Gloo
// backend] in gloo_process_group.cpp). Operations run one at a time in issue order; after one
// fails, every later operation of the group fails at once with the first error.
#pragma once

#include <memory>

#include "collectives/process_group.h"

namespace mtrain {

// A collective: every rank creates its groups in the same order, over the same store. The
// master (where the store lives) decides the local interface; it comes from the store when it
// is a TcpStore, else MASTER_ADDR/MASTER_PORT, else loopback. Connection errors are CommError
// or TimeoutError.
std::unique_ptr<ProcessGroup> create_gloo_process_group(std::shared_ptr<Store> store, int rank,
                                                        int size, ProcessGroupOptions options);

}  // namespace mtrain
