// The process groups a distributed run trains with: one for tensors on the training
// device, one for small host values.
//
// Note [Control-plane collectives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Besides the gradients, a run exchanges small values the host needs at once: the
// configuration and replica hashes (rank_consensus.h), the reducer's stop vote and
// per-rank sample counts, the epoch and evaluation sums, the checkpoint headers and
// error texts (checkpointer.h), and the final barrier. These are host tensors, read on
// the host right after the collective. NCCL only takes GPU tensors, so when the
// gradient group is NCCL the run opens a second group, "control", with Gloo over the
// same rendezvous store, and every control-plane collective goes there; with Gloo or
// MPI the one group carries both (host tensors pass straight through their host
// staging of GPU tensors). The alternative, moving each small value to the GPU and
// back around an NCCL call, was rejected because
//   - every such value would cost two copies and a stream synchronisation, and the
//     code that builds and reads them (hashes, headers, error texts) would have to know
//     about devices;
//   - on the NCCL stream the values would queue behind whatever gradient traffic is in
//     flight, so a stop vote or a failed checkpoint's message would wait for it;
//   - a Gloo group still reports a rank-consensus or checkpoint error when the GPU
//     side is what is failing.
// The cost is one more Gloo rendezvous at start-up and a few TCP connections per rank.
// Each group keeps its own operation order, the same on every rank, because every rank
// issues both groups' operations in the same program order; the two never wait on
// each other (NCCL operations are queued on the GPU and progress on their own).
// PyTorch users do the same by hand (a gloo group beside the nccl one for object
// collectives and coordination).
//
// A world of one trains without groups, unless --backend nccl is given: then a
// one-rank NCCL group over an in-process store (and its control group) drives the
// DDP reducer on the one GPU, as DDP does with world_size 1, so the NCCL path can be
// exercised on a machine with a single GPU.
#pragma once

#include <memory>
#include <string>

#include "collectives/process_group.h"
#include "collectives/store.h"

namespace mtrain {

struct TrainingGroups {
  // Serves the store of a one-rank group (see the Note); else null. First, so that it
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

// Note [SyncBatchNorm's own group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A group runs its operations one at a time in issue order (Note [Gloo backend]). On
// the gradient group, every SyncBatchNorm all-reduce of backward queued behind the
// bucket all-reduce the reducer had just started (25 MiB for ResNet-18's last layers)
// and waited for it, so backward stopped until that bucket was done: the overlap the
// reducer exists for was lost for every bucket launched before a BatchNorm layer's
// backward. With Gloo, SyncBatchNorm therefore gets a group of its own, "batch-stats",
// opened over the same store right after the configuration check has shown that every
// rank runs --sync-bn (before it, a rank with the flag would wait for the group while
// the others wait in the check). Its small collectives then start at once, beside the
// bucket in flight (on the CPU on the waiting thread itself). Every rank issues each
// group's operations in the same order, so neither group waits for the other. The cost
// is one more rendezvous at start-up and one more connection per pair of ranks, and on
// a GPU with Gloo a second host-staging thread. With MPI and NCCL
// SyncBatchNorm stays on the gradient group: a second communicator there is not
// measured yet.
//
// The group for SyncBatchNorm: a new Gloo group when `groups.gradients` is Gloo, else
// `groups.gradients` itself.
std::shared_ptr<ProcessGroup> create_batch_stats_group(const TrainingGroups& groups);

// Puts this rank's backend and kind of device on the store and, on ranks other than 0,
// throws InvalidArgument naming both when rank 0's differ (Note [Agreeing on the backend
// first] in training_groups.cpp). create_training_groups calls it first.
void require_rank0_backend(Store& store, int rank, const std::string& backend, Device device);

// The one-rank NCCL group of the Note (and its control group) on GPU `device`, over a
// store this process serves on the loopback interface.
TrainingGroups create_single_rank_nccl_groups(Device device, const ProcessGroupOptions& options);

}  // namespace mtrain
