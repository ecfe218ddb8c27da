// Per-thread cuDNN and cuBLAS handles and their workspaces.
//
// Note [Library handles]
// ~~~~~~~~~~~~~~~~~~~~~~
// A cuDNN or cuBLAS handle belongs to the device that was current when it was created
// and carries a stream and (cuBLAS) a workspace as state, so sharing one between
// threads would race on that state. Each thread therefore gets its own pair per device,
// created on first use and destroyed when the thread exits (PyTorch keeps a pool per
// (device, thread) for the same reason). Every accessor binds the handle to the
// calling thread's current stream of that device (Note [Current stream] in stream.h)
// before returning it, so library kernels queue exactly where mtrain's own kernels do.
//
// cuBLAS needs a workspace for some GEMM kernels. cublasSetStream resets it to the
// library's default pool, which is cudaMalloc'd outside the caching allocator and, when
// one handle is used on several streams, shared between them (work on two streams could
// then scribble over each other's scratch). So every (thread, device, stream) gets its
// own workspace from the caching allocator, bound with cublasSetWorkspace whenever the
// handle moves to that stream: the size NVIDIA recommends, 32 MiB on Hopper (sm_90) and
// newer, 4 MiB before. With a fixed workspace per stream, cuBLAS results are bitwise
// reproducible from run to run on the same GPU model.
#include "tensor/cuda/library_handles.h"

#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <vector>

#include "core/error.h"
#include "tensor/cuda/cublas_loader.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_memory.h"

namespace mtrain::cuda {
namespace {

// What one thread holds for one device.
struct DeviceHandles {
  cudnnHandle_t cudnn = nullptr;
  cublasHandle_t cublas = nullptr;
  // The stream the cuBLAS handle and its workspace are bound to; meaningless until
  // `cublas_bound`, which is false again while a rebinding is half done.
  bool cublas_bound = false;
  cudaStream_t cublas_stream = nullptr;
  std::map<cudaStream_t, Tensor> cublas_workspaces;
};

class ThreadHandles {
 public:
  ThreadHandles() = default;
  ThreadHandles(const ThreadHandles&) = delete;
  ThreadHandles& operator=(const ThreadHandles&) = delete;

  // Destroys the handles at thread exit. Errors cannot be reported from here; a handle
  // whose destruction fails is leaked, which is all that could be done with it anyway.
  ~ThreadHandles() {
    int previous = 0;
    const bool have_previous = cudaGetDevice(&previous) == cudaSuccess;
    for (size_t d = 0; d < devices_.size(); ++d) {
      DeviceHandles& h = devices_[d];
      // The workspaces go back to their streams' pools, which only reuse them after the
      // work already queued there (Note [Stream-ordered block reuse]).
      h.cublas_workspaces.clear();
      if (h.cudnn == nullptr && h.cublas == nullptr) continue;
      if (cudaSetDevice(static_cast<int>(d)) != cudaSuccess) continue;
      if (h.cublas != nullptr) cublas().destroy(h.cublas);
      if (h.cudnn != nullptr) cudnnDestroy(h.cudnn);
    }
    if (have_previous) cudaSetDevice(previous);
  }

  DeviceHandles& on(int device) {
    MTRAIN_CHECK(device >= 0, "library handles requested for device {}", device);
    const auto d = static_cast<size_t>(device);
    if (d >= devices_.size()) devices_.resize(d + 1);
    return devices_[d];
  }

 private:
  std::vector<DeviceHandles> devices_;  // index = device
};

thread_local ThreadHandles t_handles;

// NVIDIA's recommended cuBLAS workspace (cublasSetWorkspace in the cuBLAS guide).
size_t cublas_workspace_bytes(int device) {
  int major = 0;
  MTRAIN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9 ? size_t{32} << 20 : size_t{4} << 20;
}

// cuDNN keeps a more detailed message for the last failure on this thread.
std::string cudnn_last_error_detail() {
  char buffer[1024] = {};
  cudnnGetLastErrorString(buffer, sizeof(buffer));
  return std::string(buffer);
}

}  // namespace

cudnnHandle_t cudnn_handle(int device) {
  DeviceHandles& h = t_handles.on(device);
  if (h.cudnn == nullptr) {
    DeviceGuard guard(device);
    cudnnHandle_t created = nullptr;
    MTRAIN_CUDNN_CHECK(cudnnCreate(&created),
                       fmt::format("creating the cuDNN handle of cuda:{}", device));
    h.cudnn = created;
  }
  const cudaStream_t stream = current_stream(device).handle();
  MTRAIN_CUDNN_CHECK(cudnnSetStream(h.cudnn, stream),
                     fmt::format("binding the cuDNN handle of cuda:{} to stream {}", device,
                                 static_cast<const void*>(stream)));
  return h.cudnn;
}

cublasHandle_t cublas_handle(int device) {
  DeviceHandles& h = t_handles.on(device);
  if (h.cublas == nullptr) {
    DeviceGuard guard(device);
    cublasHandle_t created = nullptr;
    MTRAIN_CUBLAS_CHECK(cublas().create(&created),
                        fmt::format("creating the cuBLAS handle of cuda:{}", device));
    h.cublas = created;
  }
  const cudaStream_t stream = current_stream(device).handle();
  if (h.cublas_bound && h.cublas_stream == stream) return h.cublas;

  // cublasSetStream drops the workspace, so the two are always set together.
  h.cublas_bound = false;
  const auto context = [&] {
    return fmt::format("binding the cuBLAS handle of cuda:{} to stream {}", device,
                       static_cast<const void*>(stream));
  };
  MTRAIN_CUBLAS_CHECK(cublas().set_stream(h.cublas, stream), context());
  Tensor& ws = h.cublas_workspaces[stream];
  if (!ws.defined()) ws = workspace(device, cublas_workspace_bytes(device));
  MTRAIN_CUBLAS_CHECK(cublas().set_workspace(h.cublas, ws.raw_data(), ws.nbytes()), context());
  h.cublas_stream = stream;
  h.cublas_bound = true;
  return h.cublas;
}

Tensor workspace(int device, size_t bytes) {
  if (bytes == 0) return Tensor();
  return Tensor::empty({static_cast<int64_t>(bytes)}, DType::UInt8, Device::cuda(device));
}

size_t workspace_limit(int device) {
  DeviceGuard guard(device);
  size_t free_bytes = 0, total_bytes = 0;
  MTRAIN_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  // A CUDA graph's cached blocks stay its own (Note [Captured steps] in tensor/cuda_graph.h).
  const BlockAllocatorStats stats = cuda_memory_stats(device);
  return free_bytes + stats.cached_bytes - stats.private_cached_bytes;
}

std::string cudnn_error_text(cudnnStatus_t status) {
  const std::string detail = cudnn_last_error_detail();
  return fmt::format("{}{}{}", cudnnGetErrorString(status), detail.empty() ? "" : ": ", detail);
}

void throw_cudnn_error(cudnnStatus_t status, const char* call, const std::string& context,
                       const char* file, int line) {
  throw Error(fmt::format("{} failed at {}:{} while {}: {}", call, file, line, context,
                          cudnn_error_text(status)));
}

void throw_cublas_error(cublasStatus_t status, const char* call, const std::string& context,
                        const char* file, int line) {
  throw Error(fmt::format("{} failed at {}:{} while {}: {} ({})", call, file, line, context,
                          cublas().status_name(status), cublas().status_string(status)));
}

}  // namespace mtrain::cuda
