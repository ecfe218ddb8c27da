// The CUDA side of the caching allocators: cudaMalloc/cudaHostAlloc and pooled events
// behind CachingBlockAllocator (whose logic lives in tensor/caching_block_allocator.cpp),
// one allocator per device plus one for pinned host memory.
#include <fmt/format.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "tensor/caching_block_allocator.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_memory.h"
#include "tensor/cuda_devices.h"
#include "tensor/cuda_hooks.h"

namespace mtrain {
namespace {

constexpr StreamKey kHostOwner{-1, 0};

class CudaBlockBackend final : public BlockBackend {
 public:
  // device >= 0: device memory of that device; -1: pinned host memory.
  explicit CudaBlockBackend(int device) : device_(device) {}

  void* allocate(size_t bytes) override {
    void* ptr = nullptr;
    cudaError_t err;
    if (device_ >= 0) {
      cuda::DeviceGuard guard(device_);
      err = cudaMalloc(&ptr, bytes);
    } else {
      adopt_process_device();  // Note [Helper threads and the process's GPU]
      // Portable: pinned for every device, since any device's stream may copy from it.
      err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    }
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky, but clear it so later checks start clean
      return nullptr;
    }
    MTRAIN_CUDA_CHECK(err);
    return ptr;
  }

  void free(void* ptr) override {
    if (device_ >= 0) {
      cuda::DeviceGuard guard(device_);
      MTRAIN_CUDA_CHECK(cudaFree(ptr));
    } else {
      adopt_process_device();
      MTRAIN_CUDA_CHECK(cudaFreeHost(ptr));
    }
  }

  EventRef record_event(StreamKey stream) override {
    cuda::DeviceGuard guard(stream.device);
    std::vector<cudaEvent_t>& pool = event_pools_[stream.device];
    cudaEvent_t event = nullptr;
    if (pool.empty()) {
      MTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    } else {
      event = pool.back();
      pool.pop_back();
    }
    const cudaError_t err = cudaEventRecord(event, reinterpret_cast<cudaStream_t>(stream.handle));
    if (err != cudaSuccess) {
      pool.push_back(event);
      MTRAIN_CUDA_CHECK(err);
    }
    return EventRef{event, stream.device};
  }

  bool event_completed(EventRef event) override {
    adopt_process_device();
    return MTRAIN_CUDA_QUERY(cudaEventQuery(static_cast<cudaEvent_t>(event.handle)));
  }

  void synchronize_event(EventRef event) override {
    adopt_process_device();
    MTRAIN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event.handle)));
  }

  void release_event(EventRef event) override {
    event_pools_[event.device].push_back(static_cast<cudaEvent_t>(event.handle));
  }

  std::string memory_summary() override {
    if (device_ < 0) return {};
    cuda::DeviceGuard guard(device_);
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      cudaGetLastError();
      return {};
    }
    return fmt::format("the device has {} free of {}", format_bytes(free_bytes),
                       format_bytes(total_bytes));
  }

 private:
  const int device_;
  std::unordered_map<int, std::vector<cudaEvent_t>> event_pools_;  // by event device
};

// An Allocator (what Storage uses) over a CachingBlockAllocator: blocks are allocated for
// the current stream of the device.
class CudaCachingAllocator final : public Allocator {
 public:
  CudaCachingAllocator(int device, std::string name, bool pinned)
      : device_(device), pinned_(pinned), backend_(pinned ? -1 : device),
        cache_(backend_, std::move(name), /*cross_stream_events=*/!pinned) {}

  void* allocate(size_t bytes) override {
    // Pinned blocks belong to the host, which is no device stream (kHostOwner cannot
    // equal one); the device streams that copy from or to them are declared through
    // record_stream.
    if (pinned_) return cache_.allocate(bytes, kHostOwner);
    const cuda::Stream stream = cuda::current_stream(device_);
    return cache_.allocate(bytes, StreamKey{device_, reinterpret_cast<uintptr_t>(stream.handle())});
  }
  void deallocate(void* ptr, size_t /*bytes*/) override { cache_.deallocate(ptr); }
  bool pinned_host() const override { return pinned_; }

  CachingBlockAllocator& cache() { return cache_; }

 private:
  const int device_;
  const bool pinned_;
  CudaBlockBackend backend_;
  CachingBlockAllocator cache_;
};

void check_device(int device) {
  const CudaInfo& info = cuda_info();
  if (device < 0 || device >= info.device_count) {
    if (info.device_count == 0) {
      throw InvalidArgument(fmt::format("device cuda:{} is not available: no usable GPU ({})", device,
                                        info.reason));
    }
    throw InvalidArgument(fmt::format("device cuda:{} does not exist: {} GPU(s) visible ({})", device,
                                      info.device_count, cuda_summary()));
  }
}

// Created on first use and never destroyed, so tensors that die during static
// destruction can still return their memory.
CudaCachingAllocator& device_allocator(int device) {
  check_device(device);
  static std::mutex mu;
  static auto* allocators = new std::vector<CudaCachingAllocator*>();
  std::lock_guard<std::mutex> lock(mu);
  if (allocators->empty()) allocators->resize(static_cast<size_t>(cuda_info().device_count), nullptr);
  CudaCachingAllocator*& a = (*allocators)[static_cast<size_t>(device)];
  if (a == nullptr) a = new CudaCachingAllocator(device, fmt::format("cuda:{}", device), false);
  return *a;
}

CudaCachingAllocator& pinned_caching_allocator() {
  static auto* a = [] {
    if (cuda_info().device_count == 0) {
      throw InvalidArgument(fmt::format("pinned host memory needs a usable GPU: {}",
                                        cuda_info().reason));
    }
    return new CudaCachingAllocator(-1, "pinned host memory", true);
  }();
  return *a;
}

}  // namespace

namespace detail {
Allocator& cuda_allocator(int device) { return device_allocator(device); }
Allocator& pinned_allocator() { return pinned_caching_allocator(); }
void set_private_stream(int device, void* stream, bool on) {
  device_allocator(device).cache().set_private(StreamKey{device, reinterpret_cast<uintptr_t>(stream)}, on);
}
}  // namespace detail

BlockAllocatorStats cuda_memory_stats(int device) { return device_allocator(device).cache().stats(); }
void cuda_release_cached_memory(int device) { device_allocator(device).cache().release_cached(); }
BlockAllocatorStats pinned_memory_stats() { return pinned_caching_allocator().cache().stats(); }
void pinned_release_cached_memory() { pinned_caching_allocator().cache().release_cached(); }

void record_stream(const Tensor& tensor, int device, void* stream_handle) {
  if (!tensor.defined()) return;
  const auto& storage = tensor.storage();
  if (!storage->owned()) return;  // borrowed memory: its owner manages its lifetime
  const StreamKey key{device, reinterpret_cast<uintptr_t>(stream_handle)};
  if (storage->device().is_cuda()) {
    device_allocator(storage->device().index).cache().record_stream(storage->data(), key);
  } else if (storage->pinned()) {
    pinned_caching_allocator().cache().record_stream(storage->data(), key);
  }
}

}  // namespace mtrain
