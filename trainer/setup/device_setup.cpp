#include "trainer/setup/device_setup.h"

#include <fmt/format.h>

#include "core/env.h"
#include "core/error.h"
#include "tensor/cuda_ops.h"
#include "tensor/cuda_runtime.h"

namespace mtrain {

TrainingDevice set_up_training_device(const TrainOptions& o, const WorkerEnvironment& env) {
  const CudaInfo& cuda = cuda_info();
  DeviceRequest request;
  request.device = o.device;
  request.backend = o.backend;
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
