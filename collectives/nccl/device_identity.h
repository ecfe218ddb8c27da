// One GPU per rank: NCCL hangs or fails obscurely when two ranks of a communicator drive
// the same GPU, so every rank publishes which physical GPU it uses (host name + PCI bus
// id) through the store before ncclCommInitRank, and every rank checks the whole list.
// CUDA-free so that it is tested on machines without GPUs.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "store/store.h"

namespace mtrain {

struct DeviceIdentity {
  std::string host;     // gethostname()
  std::string pci_bus;  // cudaDeviceGetPCIBusId, e.g. "0000:3B:00.0"
  std::string label;    // the rank's own name for it, e.g. "cuda:0"
};

// The first pair of ranks (i < j) whose identities name the same GPU of the same host.
std::optional<std::pair<int, int>> find_shared_device(const std::vector<DeviceIdentity>& ranks);

// Publishes `self` under `<prefix>/device/<rank>`, waits for every rank's entry (up to
// `timeout`) and throws InvalidArgument naming both ranks, the device and the host when
// two ranks share a GPU, suggesting the gloo backend. Every rank reaches the same
// verdict, so all fail together instead of some hanging in NCCL.
void check_one_device_per_rank(Store& store, const std::string& prefix, const std::string& group,
                               int rank, int size, const DeviceIdentity& self, Millis timeout);

// This machine's host name (for DeviceIdentity::host).
std::string local_host_name();

}  // namespace mtrain
