#include "trainer/ddp/training_groups.h"

#include <fmt/format.h>

#include "core/error.h"

namespace mtrain {

// Note [Agreeing on the backend first]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The configuration check (rank_consensus.h) runs over a group, and ranks that resolved
// different backends never get one: a Gloo rank waits for peers that sit in NCCL's
// set-up, for --timeout (30 min by default). `--device auto` on a node whose GPU is
// unusable does exactly that. So before any group is made, every rank puts what it
// resolved on the store and compares it with rank 0's; a rank that differs fails at
// once, naming both, and the launcher tears the gang down with that as the root cause.
void require_rank0_backend(Store& store, int rank, const std::string& backend, Device device) {
  const std::string mine = fmt::format("{} on {}", backend, device.is_cuda() ? "a GPU" : "the CPU");
  store.set(fmt::format("mtrain/backend/{}", rank), mine);
  if (rank == 0) return;
  const std::string rank0 = store.get_string("mtrain/backend/0");
  if (rank0 != mine) {
    throw InvalidArgument(fmt::format(
        "rank {} trains with {} but rank 0 with {}: every rank must use the same backend and kind of device "
        "(with --device auto, a rank whose GPU is unusable falls back to the CPU: check that rank's GPU, or "
        "pass --device and --backend explicitly)",
        rank, mine, rank0));
  }
}

// Note [Control-plane collectives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Besides the gradients, a run exchanges small values the host needs at once: the configuration
// and replica hashes (rank_consensus.h), each step's exchange (step_exchange.h), the
// epoch and evaluation sums, the checkpoint headers and error texts (checkpointer.h), and the
// final barrier. NCCL only takes GPU tensors, so when the gradient group is NCCL the run opens a
// second group, "control", with Gloo over the same store, and every control-plane collective goes
// there; with Gloo or MPI the one group carries both. Moving each small value to the GPU and back
// around an NCCL call instead would
//   - cost two copies and a stream synchronisation per value, and make the code that builds and
//     reads them (hashes, headers, error texts) know about devices;
//   - queue a stop vote or a failed checkpoint's message behind the gradient traffic in flight;
//   - lose the rank-consensus or checkpoint error when the GPU side is what is failing.
// The cost is one more Gloo rendezvous at start-up and a few TCP connections per rank. Each group
// keeps its own operation order, the same on every rank, because every rank issues both groups'
// operations in the same program order; the two never wait on each other (NCCL operations are
// queued on the GPU and progress on their own). PyTorch users do the same by hand.
TrainingGroups create_training_groups(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                      int size, Device device, const ProcessGroupOptions& options) {
  MTRAIN_CHECK(backend != "auto", "create_training_groups needs a resolved backend, found auto");
  const BackendInfo& info = backend_info(backend);
  if (info.device_tensors_only && store == nullptr) {
    // The control group is Gloo, which needs the store even where NCCL could do without.
    throw InvalidArgument(
        "--backend nccl needs a rendezvous store for its NCCL id and for the Gloo control group "
        "(Note [Control-plane collectives]), and this run has none: start the workers with mtrain-launch, or "
        "set MASTER_ADDR and MASTER_PORT");
  }
  if (store != nullptr && size > 1) require_rank0_backend(*store, rank, backend, device);
  TrainingGroups groups;
  groups.store = store;
  groups.device = device;
  groups.gradients = create_process_group(backend, store, rank, size, device, options);
  if (!info.device_tensors_only) {
    groups.control = groups.gradients;
    return groups;
  }
  ProcessGroupOptions control_options = options;
  control_options.name = "control";
  groups.control = create_process_group("gloo", std::move(store), rank, size, Device::cpu(), control_options);
  return groups;
}

// Note [SyncBatchNorm's own group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A group runs its operations one at a time in issue order (Note [Gloo backend]). On the gradient
// group, each SyncBatchNorm all-reduce of backward would queue behind the bucket all-reduce the
// reducer has just started and wait for it, so backward would stop until that bucket is done: the
// overlap the reducer exists for would be lost for every bucket launched before a BatchNorm
// layer's backward. With Gloo, SyncBatchNorm therefore gets a group of its own, "batch-stats",
// opened right after the configuration check has shown that every rank runs --sync-bn (before it,
// a rank with the flag would wait for the group while the others wait in the check). Its small
// collectives then start at once, beside the bucket in flight. Every rank issues each group's
// operations in the same order, so neither group waits for the other. The cost is one more
// rendezvous at start-up, one more connection per pair of ranks, and on a GPU a second
// host-staging thread. With MPI and NCCL SyncBatchNorm stays on the gradient group: a second
// communicator there is not measured yet.
std::shared_ptr<ProcessGroup> create_batch_stats_group(const TrainingGroups& groups) {
  MTRAIN_CHECK(groups.gradients != nullptr, "create_batch_stats_group needs the training groups, found none");
  if (!backend_info(groups.gradients->backend_name()).batch_stats_group) return groups.gradients;
  const ProcessGroup& gradients = *groups.gradients;
  ProcessGroupOptions options = gradients.options();
  options.name = "batch-stats";
  return create_process_group("gloo", groups.store, gradients.rank(), gradients.size(), groups.device, options);
}

TrainingGroups create_single_rank_nccl_groups(Device device, const ProcessGroupOptions& options) {
  const std::string token = generate_store_token();
  auto server = std::make_shared<TcpStoreServer>("127.0.0.1", 0, token);
  auto store = std::make_shared<TcpStore>("127.0.0.1", server->port(), token);
  TrainingGroups groups = create_training_groups("nccl", std::move(store), 0, 1, device, options);
  groups.local_store_server = std::move(server);
  return groups;
}

}  // namespace mtrain
