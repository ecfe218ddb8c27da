#include <atomic>

#include <cuda_runtime.h>
#include <cudnn.h>

#include "tensor/cuda_devices.h"
#include "core/error.h"
#include "tensor/cuda/cuda_check.h"

namespace mtrain {
namespace {

// Note [Helper threads and the process's GPU] (tensor/cuda_devices.h).
std::atomic<int>& process_device() {
  static std::atomic<int> device{-1};
  return device;
}

bool& thread_adopted() {
  thread_local bool adopted = false;
  return adopted;
}

// Why no GPU is usable, in plain words for the common cases (a CPU-only machine has no
// driver at all, which CUDA calls an insufficient driver), with CUDA's name for the rest.
std::string no_gpu_reason(cudaError_t err, int driver_version) {
  if (err == cudaErrorInsufficientDriver && driver_version == 0) return "no NVIDIA driver is installed";
  if (err == cudaErrorInsufficientDriver) {
    return fmt::format("the NVIDIA driver supports CUDA {}.{}, older than this build needs", driver_version / 1000,
                       (driver_version % 1000) / 10);
  }
  if (err == cudaErrorNoDevice) return "the driver finds no NVIDIA GPU";
  return fmt::format("{} ({})", cudaGetErrorString(err), cudaGetErrorName(err));
}

CudaInfo query() {
  CudaInfo info;
  info.compiled = true;
  cudaRuntimeGetVersion(&info.runtime_version);
  cudaDriverGetVersion(&info.driver_version);
  info.cudnn_version = static_cast<int>(cudnnGetVersion());
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls start clean
    info.device_count = 0;
    info.reason = no_gpu_reason(err, info.driver_version);
    return info;
  }
  info.device_count = n;
  if (n == 0) info.reason = "the CUDA runtime reports no devices";
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) == cudaSuccess) {
      info.device_names.emplace_back(prop.name);
    } else {
      info.device_names.emplace_back("unknown");
    }
  }
  return info;
}

}  // namespace

const CudaInfo& cuda_info() {
  static const CudaInfo info = query();
  return info;
}

void set_current_device(int index) {
  const CudaInfo& info = cuda_info();
  if (index < 0 || index >= info.device_count) {
    throw InvalidArgument(fmt::format("cannot make cuda:{} the current device: {}", index,
                                      info.device_count == 0
                                          ? fmt::format("no usable GPU ({})", info.reason)
                                          : fmt::format("{} visible", info.device_count)));
  }
  MTRAIN_CUDA_CHECK(cudaSetDevice(index));
  process_device().store(index);
  thread_adopted() = true;
}

void adopt_process_device() {
  if (thread_adopted()) return;
  const int device = process_device().load();
  if (device < 0) return;  // not bound yet: a later call adopts it
  thread_adopted() = true;
  // An error here resurfaces, with its context, at the caller's next checked call.
  if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
}

}  // namespace mtrain
