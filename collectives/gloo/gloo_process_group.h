// The Gloo backend: CPU collectives over TCP, bootstrapped through the mtrain store.
//
// Note [Gloo backend]
// ~~~~~~~~~~~~~~~~~~~
// One gloo::rendezvous::Context per group, connected as a full mesh through the store
// it is given (already scoped to the job attempt: see connect_store_from_env) under
// "gloo/<group name>/<n>", n = the number of groups this process created before (every
// rank creates its groups in the same order, so the counters agree). Operations run one
// at a time in issue order, on the group's communication thread or on the thread
// waiting for them (Note [Running an operation on the waiting thread] in
// operation_queue.h), through the library's algorithms: gloo::allreduce (ring / bcube
// chosen by gloo), gloo::broadcast, gloo::allgather(v), gloo::barrier and
// gloo::ReduceScatterHalvingDoubling (in place, on a scratch copy of the input). After
// an operation fails the context is in an unknown state (a half-finished exchange), so
// every later operation of the group fails at once with the first error.
#pragma once

#include <memory>

#include "collectives/process_group.h"

namespace mtrain {

// The master (where the store lives) decides the local interface; it comes from the
// store when it is a TcpStore, else MASTER_ADDR/MASTER_PORT, else loopback.
std::unique_ptr<ProcessGroup> create_gloo_process_group(std::shared_ptr<Store> store, int rank,
                                                        int size, ProcessGroupOptions options);

}  // namespace mtrain
