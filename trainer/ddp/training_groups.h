// The process groups a distributed run trains with: `gradients` for tensors on the training
// device, `control` for small host values read at once (Note [Control-plane collectives] in
// training_groups.cpp), and optionally a group of SyncBatchNorm's own (Note [SyncBatchNorm's own
// group]). Every function here is collective: every rank calls it, in the same order, with the
// same backend. A world of one trains without groups, unless --backend nccl is given: then a
// one-rank NCCL group over an in-process store (and its control group) drives the DDP reducer on
// the one GPU, as DDP does with world_size 1.
#pragma once

#include <memory>
#include <string>

#include "collectives/process_group.h"
#include "store/store.h"

namespace mtrain {

struct TrainingGroups {
  // Serves the store of a one-rank NCCL group; else null. First, so that it
  // is destroyed after the groups that talk to it.
  std::shared_ptr<TcpStoreServer> local_store_server;
  // Device tensors: gradient buckets, the start-up broadcast of the model and of
  // restored momentum, SyncBatchNorm unless it has a group of its own (Note
  // [SyncBatchNorm's own group]). Null in a world of one without a group.
  std::shared_ptr<ProcessGroup> gradients;
  // Host tensors (Note [Control-plane collectives]); the same object as `gradients`
  // unless that is NCCL.
  std::shared_ptr<ProcessGroup> control;
  // What `gradients` was made over, for groups made later (create_batch_stats_group;
  // rank, size and options come from `gradients` itself): the rendezvous store (null
  // for MPI under an MPI starter) and the training device.
  std::shared_ptr<Store> store;
  Device device = Device::cpu();

  explicit operator bool() const { return gradients != nullptr; }
};

// Creates the groups for `backend` (already resolved: gloo, mpi or nccl) on `device`.
// `store` may be null only for mpi. Throws InvalidArgument when NCCL is asked for
// without a store.
TrainingGroups create_training_groups(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                      int size, Device device, const ProcessGroupOptions& options);

// The group for SyncBatchNorm (Note [SyncBatchNorm's own group] in training_groups.cpp): a new
// Gloo group "batch-stats" over the same store when `groups.gradients` is Gloo, else
// `groups.gradients` itself. Call only after every rank has been shown to run --sync-bn.
std::shared_ptr<ProcessGroup> create_batch_stats_group(const TrainingGroups& groups);

// Puts this rank's backend and kind of device on the store and, on ranks other than 0,
// throws InvalidArgument naming both when rank 0's differ (Note [Agreeing on the backend
// first] in training_groups.cpp). create_training_groups calls it first.
void require_rank0_backend(Store& store, int rank, const std::string& backend, Device device);

// The one-rank NCCL group (and its control group) on GPU `device`, over a store this process
// serves on the loopback interface.
TrainingGroups create_single_rank_nccl_groups(Device device, const ProcessGroupOptions& options);

}  // namespace mtrain
