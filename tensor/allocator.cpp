// The caching host allocator.
//
// Note [Host caching allocator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Training allocates the same sizes every step (activations, gradients, batches), so
// freed blocks go into per-size free lists and the next request of a similar size
// reuses one: after the first step no request reaches the system allocator, and the
// bookkeeping itself allocates nothing either (each block carries its size in a
// 64-byte header in front of the user pointer, and a free list keeps its capacity when
// it empties). Sizes are rounded up (to 512 B below 1 MiB, to 64 KiB above) so
// near-equal requests share blocks; a cached block is reused only if it is at most
// twice the request, so a tiny tensor never pins a huge block. The allocator is created
// once and never destroyed, so tensors that die during static destruction can still
// return their memory.
//
// A cache hides use-after-free from AddressSanitizer (a freed block is still
// allocated as far as malloc knows), so in ASan builds a cached block is poisoned
// while it waits and unpoisoned when it is handed out again.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "tensor/tensor.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define MTRAIN_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define MTRAIN_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define MTRAIN_POISON(p, n) ((void)(p), (void)(n))
#define MTRAIN_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace mtrain {
namespace {

constexpr size_t kAlignment = 64;
constexpr size_t kHeader = kAlignment;  // keeps the user pointer 64-byte aligned
constexpr uint64_t kMagic = 0x6d747261696e3634ULL;  // marks blocks this allocator made

struct BlockHeader {
  size_t size;     // usable bytes after the header
  uint64_t magic;
};
static_assert(sizeof(BlockHeader) <= kHeader);

size_t round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  const size_t quantum = bytes < (1u << 20) ? 512 : (64u << 10);
  return (bytes + quantum - 1) / quantum * quantum;
}

BlockHeader* header_of(void* user) {
  return reinterpret_cast<BlockHeader*>(static_cast<char*>(user) - kHeader);
}

class CachingHostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    if (bytes > SIZE_MAX / 2 - kHeader) {
      throw InvalidArgument(fmt::format("host allocator: cannot allocate {} bytes", bytes));
    }
    const size_t size = round_size(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    // The smallest cached block that fits and is at most twice the request.
    for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= 2 * size; ++it) {
      if (it->second.empty()) continue;
      void* p = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= it->first;
      stats_.in_use_bytes += it->first;
      stats_.cache_hits++;
      note_peaks();
      MTRAIN_UNPOISON(p, it->first);
      return p;
    }
    void* raw = std::aligned_alloc(kAlignment, kHeader + size);
    if (raw == nullptr) {
      // Give the cache back to the system and try once more before failing.
      release_locked();
      raw = std::aligned_alloc(kAlignment, kHeader + size);
      if (raw == nullptr) {
        throw OutOfMemoryError(fmt::format("host allocator: out of memory allocating {} bytes "
                                "({} bytes already in use)", size, stats_.in_use_bytes));
      }
    }
    auto* h = static_cast<BlockHeader*>(raw);
    h->size = size;
    h->magic = kMagic;
    stats_.system_allocs++;
    stats_.in_use_bytes += size;
    note_peaks();
    return static_cast<char*>(raw) + kHeader;
  }

  void deallocate(void* ptr, size_t /*bytes*/) noexcept override {
    if (ptr == nullptr) return;
    BlockHeader* h = header_of(ptr);
    if (h->magic != kMagic) std::abort();  // not ours: memory corruption, stop at once
    std::lock_guard<std::mutex> lock(mu_);
    stats_.in_use_bytes -= h->size;
    stats_.cached_bytes += h->size;
    MTRAIN_POISON(ptr, h->size);
    // push_back may grow the list (a system allocation) only until the list has seen
    // its steady-state depth; after that it reuses the capacity.
    free_[h->size].push_back(ptr);
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
  void note_peaks() {
    stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
    stats_.peak_reserved_bytes =
        std::max(stats_.peak_reserved_bytes, stats_.in_use_bytes + stats_.cached_bytes);
  }

  void release_locked() {
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) {
        MTRAIN_UNPOISON(p, header_of(p)->size);  // hand ASan back a block it can recycle
        std::free(header_of(p));
      }
      blocks.clear();
    }
    stats_.cached_bytes = 0;
  }

  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // block size -> cached blocks
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
