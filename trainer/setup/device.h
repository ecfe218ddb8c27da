// Which device a worker trains on (from --device, --backend, its local rank and the
// GPUs it can see) and setting it up: making it the process's current GPU and applying
// the GPU numerics flags. One process per GPU, as torchrun with DDP (Note [Device
// binding] in device.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "collectives/process_group.h"
#include "tensor/tensor.h"
#include "core/speedups.h"
#include "trainer/options.h"
#include "trainer/setup/environment.h"

namespace mtrain {

struct DeviceRequest {
  DeviceChoice device = DeviceChoice::kAuto;  // --device
  BackendChoice backend;                      // --backend; auto is resolved here
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

// The one place that decides a rank's device and backend: auto becomes auto_backend's choice
// for the device bound (`mpi_launched`: whether an MPI starter started this process). Throws
// InvalidArgument for --device cuda without a GPU, a backend of GPU tensors on a rank that
// trains on the CPU, or more local ranks than GPUs with NCCL.
DeviceBinding bind_device(const DeviceRequest& request, bool mpi_launched);

struct TrainingDevice {
  DeviceBinding binding;  // binding.device labels CPU ranks cpu:<local rank>
  // Where tensors are allocated: binding.device on a GPU, the host (Device::cpu())
  // otherwise, since every rank's host tensors live in one address space whatever
  // the label.
  Device compute = Device::cpu();
  std::string log_line;  // "device: ..." naming the device and why
};

// Binds this worker's device from --device, --backend, its local rank and the GPUs the
// CUDA runtime sees (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER); on a GPU makes it the
// current device; applies --cudnn-benchmark, --deterministic, --no-tf32 and the kernels'
// speed switches (kept and unused on the CPU). Throws InvalidArgument for a request that
// cannot be met (e.g. --device cuda without a usable GPU, quoting the runtime's reason).
TrainingDevice set_up_training_device(const TrainOptions& options, const WorkerEnvironment& env,
                                      const Speedups& speedups);

// Every rank's device for the epoch line and metrics, the same list on every rank:
// "cuda:<index>" for GPU ranks, "cpu:<global rank>" for CPU ranks ("cpu" or the one
// GPU in a world of one). A collective on `control` (host values) when it is non-null.
std::vector<std::string> all_rank_devices(ProcessGroup* control, const TrainingDevice& device);

}  // namespace mtrain
