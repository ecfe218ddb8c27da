// Which device a worker trains on, from --device, its local rank and the GPUs it can see.
//
// Note [Device binding]
// ~~~~~~~~~~~~~~~~~~~~~
// One process per GPU, as torchrun + DDP: local rank r binds cuda:r, where the index
// counts the GPUs CUDA_VISIBLE_DEVICES leaves visible (the runtime applies it, in the
// order CUDA_DEVICE_ORDER asks for: FASTEST_FIRST by default, which may differ from
// nvidia-smi's PCI order; PCI_BUS_ID makes them agree). --device auto takes a GPU when
// one is visible and the CPU otherwise; --device cuda without a usable GPU is an error
// quoting why the runtime sees none. More local ranks than visible GPUs is an error for
// NCCL, which refuses two ranks on one device; Gloo and MPI stage through host memory
// and may share, so there local rank r binds cuda:(r mod count), with a warning. One
// exception: a process that sees exactly one GPU binds it whatever its local rank,
// because schedulers that give every task its own GPU (SLURM's --gpus-per-task=1,
// --gpu-bind) leave each task that one, as cuda:0, with local ranks 0..n-1. Whether
// two ranks then really share a GPU only the ranks together can tell: the NCCL group
// compares every rank's physical GPU before it starts (collectives/nccl/device_identity.h)
// and refuses a shared one, naming both ranks.
// The CPU path binds cpu:r (a label in logs: all ranks share the host's cores, split
// by the intra-op thread count).
#pragma once

#include <optional>
#include <string>

#include "tensor/tensor.h"

namespace mtrain {

struct DeviceRequest {
  std::string device = "auto";   // --device: auto | cuda | cpu
  std::string backend = "auto";  // --backend, before "auto" is resolved
  int local_rank = 0;
  int local_world_size = 1;
  int visible_gpus = 0;                       // cuda_info().device_count
  std::string no_gpu_reason;                  // cuda_info().reason, when visible_gpus is 0
  std::optional<std::string> visible_devices;  // CUDA_VISIBLE_DEVICES, for messages
  std::optional<std::string> device_order;     // CUDA_DEVICE_ORDER, for the hint
};

struct DeviceBinding {
  Device device = Device::cpu(0);
  std::string backend;   // the backend with "auto" resolved for this device
  std::string reason;    // one line for the log: why this device
  std::string warning;   // non-empty: log it (e.g. ranks sharing a GPU)
};

// Throws InvalidArgument for a bad --device value, --device cuda without a GPU, or
// more local ranks than GPUs with NCCL. `mpi_launched` resolves backend auto on CPU
// (mpi under an MPI starter, else gloo), as create_process_group does.
DeviceBinding bind_device(const DeviceRequest& request, bool mpi_launched);

}  // namespace mtrain
