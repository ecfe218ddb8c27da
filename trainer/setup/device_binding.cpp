#include "trainer/setup/device_binding.h"

#include <fmt/format.h>

#include "core/error.h"

namespace mtrain {
namespace {

std::string visible_text(const DeviceRequest& r) {
  return r.visible_devices ? fmt::format("CUDA_VISIBLE_DEVICES={}", *r.visible_devices) : "CUDA_VISIBLE_DEVICES unset";
}

std::string resolve_backend(const std::string& backend, bool on_gpu, bool mpi_launched) {
  if (backend != "auto") return backend;
  if (on_gpu) return "nccl";
  return mpi_launched ? "mpi" : "gloo";
}

}  // namespace

DeviceBinding bind_device(const DeviceRequest& r, bool mpi_launched) {
  if (r.device != "auto" && r.device != "cuda" && r.device != "cpu") {
    throw InvalidArgument(fmt::format("--device must be auto, cuda or cpu, found '{}'", r.device));
  }
  DeviceBinding b;
  const bool gpu = r.device == "cuda" || (r.device == "auto" && r.visible_gpus > 0);
  if (!gpu) {
    b.device = Device::cpu(r.local_rank);
    b.backend = resolve_backend(r.backend, false, mpi_launched);
    b.reason = r.device == "cpu" ? "--device cpu"
                                 : fmt::format("--device auto and no usable GPU ({})", r.no_gpu_reason);
    if (b.backend == "nccl") {
      throw InvalidArgument("--backend nccl needs GPUs, but this rank trains on the CPU: use --backend gloo or mpi");
    }
    return b;
  }
  if (r.visible_gpus <= 0) {
    throw InvalidArgument(fmt::format("--device cuda, but no GPU is usable: {} ({})",
                                      r.no_gpu_reason.empty() ? "none found" : r.no_gpu_reason, visible_text(r)));
  }
  b.backend = resolve_backend(r.backend, true, mpi_launched);
  int index = r.local_rank;
  if (r.local_rank >= r.visible_gpus && r.visible_gpus == 1 && b.backend == "nccl") {
    // Note [Device binding]: one GPU per task, as SLURM's --gpus-per-task=1 gives.
    b.device = Device::cuda(0);
    b.reason = fmt::format("local rank {} -> cuda:0, the one GPU this process sees ({}); ranks that "
                           "turn out to share it are refused before NCCL starts",
                           r.local_rank, visible_text(r));
    return b;
  }
  if (r.local_rank >= r.visible_gpus) {
    if (b.backend == "nccl") {
      throw InvalidArgument(fmt::format(
          "local rank {} of {} needs its own GPU for NCCL, but only {} are visible ({}); NCCL refuses two ranks on "
          "one device: start at most {} processes per node (--nproc_per_node {}), or use --backend gloo to let ranks "
          "share GPUs",
          r.local_rank, r.local_world_size, r.visible_gpus, visible_text(r), r.visible_gpus, r.visible_gpus));
    }
    index = r.local_rank % r.visible_gpus;
    b.warning = fmt::format("{} local ranks share {} visible GPU(s) ({}): local rank {} uses cuda:{}",
                            r.local_world_size, r.visible_gpus, visible_text(r), r.local_rank, index);
  }
  b.device = Device::cuda(index);
  b.reason = fmt::format("local rank {} -> cuda:{} of {} visible ({}{})", r.local_rank, index, r.visible_gpus,
                         visible_text(r),
                         r.visible_gpus > 1 && !r.device_order
                             ? "; CUDA_DEVICE_ORDER unset, so indices follow FASTEST_FIRST, not nvidia-smi's PCI order"
                             : "");
  return b;
}

}  // namespace mtrain
