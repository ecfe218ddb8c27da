// The caching host allocator.
//
// Note [Host caching allocator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Training allocates the same sizes every step (activations, gradients, batches), so
// freed blocks go into a size-keyed free list and the next request of a similar size
// reuses one: after the first step no request reaches the system allocator. Sizes are
// rounded up (to 512 B below 1 MiB, to 64 KiB above) so near-equal requests share
// blocks; a cached block is reused only if it is at most twice the request, so a tiny
// tensor never pins a huge block. The allocator is created once and never destroyed,
// so tensors that die during static destruction can still return their memory.
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

#include "core/error.h"
#include "tensor/tensor.h"

namespace mtrain {
namespace {

constexpr size_t kAlignment = 64;

size_t round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  const size_t quantum = bytes < (1u << 20) ? 512 : (64u << 10);
  return (bytes + quantum - 1) / quantum * quantum;
}

class CachingHostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    const size_t size = round_size(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= 2 * size) {
      void* p = it->second;
      const size_t block = it->first;
      free_.erase(it);
      stats_.cached_bytes -= block;
      stats_.in_use_bytes += block;
      stats_.cache_hits++;
      sizes_[p] = block;
      return p;
    }
    void* p = std::aligned_alloc(kAlignment, size);
    if (p == nullptr) {
      // Give the cache back to the system and try once more before failing.
      release_locked();
      p = std::aligned_alloc(kAlignment, size);
      if (p == nullptr) {
        throw Error(fmt::format("host allocator: out of memory allocating {} bytes "
                                "({} bytes already in use)", size, stats_.in_use_bytes));
      }
    }
    stats_.system_allocs++;
    stats_.in_use_bytes += size;
    sizes_[p] = size;
    return p;
  }

  void deallocate(void* ptr, size_t /*bytes*/) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.find(ptr);
    MTRAIN_CHECK(it != sizes_.end(), "deallocate of a pointer this allocator never returned");
    const size_t block = it->second;
    sizes_.erase(it);
    stats_.in_use_bytes -= block;
    stats_.cached_bytes += block;
    free_.emplace(block, ptr);
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    release_locked();
  }

 private:
  void release_locked() {
    for (auto& [size, p] : free_) std::free(p);
    free_.clear();
    stats_.cached_bytes = 0;
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;  // block size -> block
  std::map<void*, size_t> sizes_;      // live block -> its size
  AllocatorStats stats_;
};

CachingHostAllocator& instance() {
  static auto* a = new CachingHostAllocator();  // intentionally never destroyed
  return *a;
}

}  // namespace

Allocator& host_allocator() { return instance(); }
AllocatorStats host_allocator_stats() { return instance().stats(); }
void host_allocator_release_cache() { instance().release(); }

}  // namespace mtrain
