#include "trainer/training_groups.h"

#include <fmt/format.h>

#include "core/error.h"

namespace mtrain {

TrainingGroups create_training_groups(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                      int size, Device device, const ProcessGroupOptions& options) {
  MTRAIN_CHECK(backend != "auto", "create_training_groups needs a resolved backend, found auto");
  if (backend == "nccl" && store == nullptr) {
    // The control group is Gloo, which needs the store even where NCCL could do without.
    throw InvalidArgument(
        "--backend nccl needs a rendezvous store for its NCCL id and for the Gloo control group "
        "(Note [Control-plane collectives]), and this run has none: start the workers with mtrain-launch, or "
        "set MASTER_ADDR and MASTER_PORT");
  }
  TrainingGroups groups;
  groups.gradients = create_process_group(backend, store, rank, size, device, options);
  if (groups.gradients->backend_name() != "nccl") {
    groups.control = groups.gradients;
    return groups;
  }
  ProcessGroupOptions control_options = options;
  control_options.name = "control";
  groups.control = create_process_group("gloo", std::move(store), rank, size, Device::cpu(), control_options);
  return groups;
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
