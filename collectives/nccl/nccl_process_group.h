// The NCCL backend: GPU collectives, one communicator per group on its own CUDA stream.
//
// Note [NCCL backend]
// ~~~~~~~~~~~~~~~~~~~
// Bootstrap: every rank publishes which GPU it drives and the group stops with a clear
// error when two ranks share one (device_identity.h); rank 0 then creates the
// ncclUniqueId and publishes it under "nccl/<group name>/<n>/unique_id" (n counts the
// groups this process created, equal on every rank since all create their groups in the
// same order), and every rank creates a non-blocking communicator with
// ncclCommInitRankConfig, polled with ncclCommGetAsyncError up to the group timeout.
// Non-blocking, because a blocking NCCL call that waits for a peer that never comes
// cannot be interrupted: here every NCCL call returns at once and the waiting is ours,
// with a deadline.
//
// Operations (Note [Asynchronous collectives]): an event recorded on the caller's current
// stream makes the group stream wait for it; the NCCL call is queued on the group stream
// (the first one may block its caller while NCCL connects the peers, up to the timeout);
// a completion event is recorded after it. The tensors stay referenced until that event
// completes. allgatherv is a group of broadcasts (ncclGroupStart/End), one per rank;
// barrier is a one-element all-reduce; avg is ncclAvg.
//
// Completion and timeouts: a watchdog thread polls the completion events in issue order,
// ncclCommGetAsyncError and the deadline of the oldest operation (issue time + timeout).
// Past it, or on an asynchronous NCCL error, it aborts the communicator (ncclCommAbort),
// which stops its kernels, and fails every pending operation: a TimeoutError names the
// operation, its sequence number, the group and, from the store's progress keys
// (collectives/collective_progress.h), the ranks that never reached it. The group is
// unusable afterwards: every later operation fails with the same error. Work::wait()
// polls the events itself (with a short backoff) instead of waiting for the watchdog, so
// a small collective is not delayed by the watchdog's period.
#pragma once

#include <memory>

#include "collectives/process_group.h"

namespace mtrain {

// `device` must be a GPU of this process; `store` backs the bootstrap and progress keys.
std::unique_ptr<ProcessGroup> create_nccl_process_group(std::shared_ptr<Store> store, int rank,
                                                        int size, Device device,
                                                        ProcessGroupOptions options);

}  // namespace mtrain
