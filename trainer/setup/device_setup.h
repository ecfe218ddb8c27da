// Start-up of the training device: which one (Note [Device binding] in
// device_binding.h), making it the process's current GPU, and the GPU numerics flags.
#pragma once

#include <string>
#include <vector>

#include "collectives/process_group.h"
#include "trainer/setup/device_binding.h"
#include "trainer/setup/environment.h"
#include "trainer/options.h"

namespace mtrain {

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
// current device; applies --cudnn-benchmark, --deterministic and --no-tf32 (kept and
// unused on the CPU). Throws InvalidArgument for a request that cannot be met (e.g.
// --device cuda without a usable GPU, quoting the runtime's reason).
TrainingDevice set_up_training_device(const TrainOptions& options, const WorkerEnvironment& env);

// Every rank's device for the epoch line and metrics, the same list on every rank:
// "cuda:<index>" for GPU ranks, "cpu:<global rank>" for CPU ranks ("cpu" or the one
// GPU in a world of one). A collective on `control` (host values) when it is non-null.
std::vector<std::string> all_rank_devices(ProcessGroup* control, const TrainingDevice& device);

}  // namespace mtrain
