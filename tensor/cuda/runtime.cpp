#include <atomic>

#include <cuda_runtime.h>
#include <cudnn.h>

#include "tensor/cuda_runtime.h"
#include "core/error.h"
#include "tensor/cuda/cuda_check.h"

namespace mtrain {
namespace {

// Note [Helper threads and the process's GPU] (tensor/cuda_runtime.h).
std::atomic<int>& process_device() {
  static std::atomic<int> device{-1};
  return device;
}

bool& thread_adopted() {
  thread_local bool adopted = false;
  return adopted;
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
    info.reason = fmt::format("{} ({})", cudaGetErrorString(err), cudaGetErrorName(err));
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
