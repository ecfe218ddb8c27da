// The NCCL backend: GPU collectives, one non-blocking communicator per group on its own CUDA
// stream (Note [NCCL backend] in nccl_process_group.cpp). Two ranks on one GPU are refused at
// creation. Past an operation's deadline, or on an asynchronous NCCL error, the communicator is
// aborted and every pending and later operation of the group fails with that error.
#pragma once

#include <memory>

#include "collectives/process_group.h"

namespace mtrain {

// `device` must be a GPU of this process; `store` backs the bootstrap and progress keys. A
// collective: every rank creates its groups in the same order.
std::unique_ptr<ProcessGroup> create_nccl_process_group(std::shared_ptr<Store> store, int rank,
                                                        int size, Device device,
                                                        ProcessGroupOptions options);

}  // namespace mtrain
