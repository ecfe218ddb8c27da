// cuda_summary() for both builds, and cuda_info() for the build without CUDA.
#include <fmt/format.h>

#include "tensor/cuda_devices.h"

namespace mtrain {

#ifndef MTRAIN_HAVE_CUDA
const CudaInfo& cuda_info() {
  static const CudaInfo info = [] {
    CudaInfo i;
    i.reason = "built without CUDA (-DMTRAIN_CUDA=OFF or no toolkit found)";
    return i;
  }();
  return info;
}
#endif

std::string cuda_summary() {
  const CudaInfo& c = cuda_info();
  if (c.device_count == 0) {
    if (!c.compiled) return fmt::format("no GPU: {}", c.reason);
    return fmt::format("CUDA {}.{} compiled, no usable GPU ({})", c.runtime_version / 1000,
                       (c.runtime_version % 1000) / 10, c.reason);
  }
  std::string s = fmt::format("{} GPU{}:", c.device_count, c.device_count == 1 ? "" : "s");
  for (size_t i = 0; i < c.device_names.size(); ++i) {
    s += fmt::format("{} {} (cuda:{})", i ? "," : "", c.device_names[i], i);
  }
  return s;
}

}  // namespace mtrain
