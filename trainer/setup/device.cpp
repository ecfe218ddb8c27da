#include "trainer/setup/device.h"

#include <fmt/format.h>

#include "core/env.h"
#include "core/error.h"
#include "tensor/cuda_ops.h"
#include "tensor/cuda_devices.h"

namespace mtrain {

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

namespace {

std::string visible_text(const DeviceRequest& r) {
  return r.visible_devices ? fmt::format("CUDA_VISIBLE_DEVICES={}", *r.visible_devices) : "CUDA_VISIBLE_DEVICES unset";
}

const BackendInfo& chosen_backend(const DeviceRequest& r, bool on_gpu, bool mpi_launched) {
  return r.backend.automatic() ? auto_backend(on_gpu, mpi_launched) : *r.backend.named;
}

}  // namespace

DeviceBinding bind_device(const DeviceRequest& r, bool mpi_launched) {
  DeviceBinding b;
  const bool gpu = r.device == DeviceChoice::kCuda || (r.device == DeviceChoice::kAuto && r.visible_gpus > 0);
  if (!gpu) {
    b.device = Device::cpu(r.local_rank);
    const BackendInfo& backend = chosen_backend(r, false, mpi_launched);
    b.backend = backend.name;
    b.reason = r.device == DeviceChoice::kCpu
                   ? "--device cpu"
                   : fmt::format("no GPU is usable ({}), so the CPU trains", r.no_gpu_reason);
    if (backend.device_tensors_only) {
      throw InvalidArgument(fmt::format("--backend {} needs GPUs, but this rank trains on the CPU ({}): use --backend "
                                        "gloo or mpi",
                                        backend.name, b.reason));
    }
    return b;
  }
  if (r.visible_gpus <= 0) {
    throw InvalidArgument(fmt::format("--device cuda, but no GPU is usable: {} ({})",
                                      r.no_gpu_reason.empty() ? "none found" : r.no_gpu_reason, visible_text(r)));
  }
  const BackendInfo& backend = chosen_backend(r, true, mpi_launched);
  b.backend = backend.name;
  int index = r.local_rank;
  if (r.local_rank >= r.visible_gpus && r.visible_gpus == 1 && backend.device_tensors_only) {
    // Note [Device binding]: one GPU per task, as SLURM's --gpus-per-task=1 gives.
    b.device = Device::cuda(0);
    b.reason = fmt::format("local rank {} -> cuda:0, the one GPU this process sees ({}); ranks that "
                           "turn out to share it are refused before NCCL starts",
                           r.local_rank, visible_text(r));
    return b;
  }
  if (r.local_rank >= r.visible_gpus) {
    if (backend.device_tensors_only) {
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

TrainingDevice set_up_training_device(const TrainOptions& o, const WorkerEnvironment& env,
                                      const Speedups& speedups) {
  const CudaInfo& cuda = cuda_info();
  DeviceRequest request;
  request.device = o.device.value;
  request.backend = o.backend.value;
  request.local_rank = env.local_rank;
  request.local_world_size = env.local_world_size;
  request.visible_gpus = cuda.device_count;
  request.no_gpu_reason = cuda.device_count == 0 ? cuda.reason : std::string();
  request.visible_devices = env::get("CUDA_VISIBLE_DEVICES");
  request.device_order = env::get("CUDA_DEVICE_ORDER");

  TrainingDevice d;
  d.binding = bind_device(request, env.mpi_launched);
  cuda_ops::NumericsOptions numerics;
  numerics.cudnn_benchmark = o.cudnn_benchmark;
  numerics.deterministic = o.deterministic;
  numerics.allow_tf32 = o.allow_tf32;
  numerics.allow_tf32_matmul = false;  // PyTorch's default since 1.12; no flag turns it on
  numerics.batchnorm_one_pass = speedups.fused_bn;
  numerics.cudnn_graph_api = speedups.cudnn_graph;
  cuda_ops::set_numerics(numerics);

  const Device device = d.binding.device;
  if (device.is_cuda()) {
    set_current_device(device.index);
    d.compute = device;
    const std::string name = static_cast<size_t>(device.index) < cuda.device_names.size()
                                 ? cuda.device_names[device.index]
                                 : std::string("unknown GPU");
    d.log_line = fmt::format(
        "device: {} ({}), {}; cuDNN benchmark {}, deterministic {}, TF32 convolutions {}, TF32 matmul off",
        device.str(), name, d.binding.reason, o.cudnn_benchmark ? "on" : "off", o.deterministic ? "on" : "off",
        o.allow_tf32 ? "on" : "off");
  } else {
    d.compute = Device::cpu();
    d.log_line = fmt::format("device: cpu, {}{}", d.binding.reason,
                             cuda.device_count > 0 ? fmt::format(" ({} visible)", cuda_summary()) : std::string());
  }
  return d;
}

std::vector<std::string> all_rank_devices(ProcessGroup* control, const TrainingDevice& device) {
  const Device mine = device.binding.device;
  if (control == nullptr) return {mine.is_cuda() ? mine.str() : "cpu"};
  // One int64 per rank: the GPU index, or -1 for a CPU rank.
  Tensor local = Tensor::from_vector<int64_t>({mine.is_cuda() ? mine.index : -1}, {1});
  Tensor all = Tensor::empty({control->size()}, DType::Int64);
  control->allgather(local, all)->wait();
  std::vector<std::string> names;
  for (int r = 0; r < control->size(); ++r) {
    const int64_t index = all.data<int64_t>()[r];
    names.push_back(index < 0 ? fmt::format("cpu:{}", r) : fmt::format("cuda:{}", index));
  }
  return names;
}

}  // namespace mtrain
