// The bookkeeping of the CUDA caching allocators (device memory and pinned host memory),
// kept apart from every CUDA call so that its logic is unit-tested on machines without a
// GPU: the memory and event functions come from a BlockBackend (tensor/cuda/ has the
// real one, tests have a fake).
//
// Note [Stream-ordered block reuse]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A block is allocated for a stream (the caller's current stream). When its tensor
// dies, kernels queued on that stream may still be using it, but any later work on the
// same stream runs after them, so the block goes back into that stream's free pool and
// serves the stream's next request at once: no synchronisation in the steady state.
// Another stream has no such ordering: when another stream asks for a free block, an
// event is recorded on the owning stream then (it follows every use queued before the
// free, and perhaps some later work), and the block moves only once that event has
// completed. Recording it at free time instead costs an event per freed tensor, some
// 300 per resnet18 training step on a GPU, nearly all of them never queried, since a
// stream almost always takes back its own blocks. Work on other streams that used the
// block (the caller said so with record_stream: a copy on a side stream, a collective on
// the group's stream) gets an event each at free time, and the block serves nobody, not
// even its own stream, until those have completed. This is PyTorch's record_stream
// contract.
//
// Sizes are rounded (512 B below 1 MiB, 256 KiB above) so that near-equal requests share
// blocks. A cached block serves a request it exceeds by at most 2x (small) or 25%
// (>= 1 MiB): device memory is too precious for a 64 MiB block to hold a 1 MiB tensor,
// and training repeats its sizes exactly, so best fit finds exact matches. Blocks are
// never split. When the backend is out of memory, every cached block is returned (after
// its events complete) and the request retried once; if it still fails the error says
// what was requested, what is in use and what stays reserved.
//
// A private stream's blocks serve that stream alone: never another stream, never returned
// by release_cached or the out-of-memory retry. A CUDA graph captured on a stream of its
// own replays into the addresses it captured, so those blocks must stay its own for as
// long as the graph lives, in use or not (Note [Captured steps] in tensor/cuda_graph.h).
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace mtrain {

// A stream as the allocator sees it: an opaque handle on a device.
struct StreamKey {
  int device = 0;
  uintptr_t handle = 0;
  auto operator<=>(const StreamKey&) const = default;
};

// An event recorded by the backend: an opaque handle on a device.
struct EventRef {
  void* handle = nullptr;
  int device = 0;
};

// Memory and events for a CachingBlockAllocator. Calls arrive under the allocator's
// lock, one at a time.
class BlockBackend {
 public:
  virtual ~BlockBackend() = default;
  // nullptr when out of memory; throws for any other failure.
  virtual void* allocate(size_t bytes) = 0;
  virtual void free(void* ptr) = 0;
  // An event that completes once the work queued on `stream` so far has finished.
  virtual EventRef record_event(StreamKey stream) = 0;
  virtual bool event_completed(EventRef event) = 0;
  virtual void synchronize_event(EventRef event) = 0;
  // The event is no longer needed (the backend may reuse it).
  virtual void release_event(EventRef event) = 0;
  // For out-of-memory messages, e.g. "1.2 GiB free of 139.8 GiB on the device".
  virtual std::string memory_summary() { return {}; }
};

struct BlockAllocatorStats {
  size_t in_use_bytes = 0;      // held by live tensors (rounded sizes)
  size_t reserved_bytes = 0;    // obtained from the backend and not returned
  size_t cached_bytes = 0;      // reserved but free, kept for reuse
  size_t private_cached_bytes = 0;  // of those, kept for private streams: no one else's
  uint64_t backend_allocs = 0;  // e.g. cudaMalloc calls
  uint64_t backend_frees = 0;
  uint64_t cache_hits = 0;      // requests served from the cache
};

// "1.5 GiB", "512 B": sizes for error messages.
std::string format_bytes(size_t bytes);

class CachingBlockAllocator {
 public:
  // `name` appears in errors ("cuda:0", "pinned host memory"). When
  // `cross_stream_events` is false, no event is ever recorded on the owning stream
  // (pinned memory: blocks belong to the host, which has no stream; device uses are
  // declared through record_stream).
  CachingBlockAllocator(BlockBackend& backend, std::string name, bool cross_stream_events = true);
  ~CachingBlockAllocator();  // returns every cached block; blocks still in use are leaked
  CachingBlockAllocator(const CachingBlockAllocator&) = delete;
  CachingBlockAllocator& operator=(const CachingBlockAllocator&) = delete;

  // Never nullptr: throws Error (out of memory) or what the backend throws.
  void* allocate(size_t bytes, StreamKey stream);
  // `ptr` must come from allocate(); the block becomes reusable per Note [Stream-ordered
  // block reuse]. Never throws: a backend failure leaks the block instead of reusing it.
  void deallocate(void* ptr) noexcept;
  // The block at `ptr` (as returned by allocate) is used by work on `stream` too.
  void record_stream(void* ptr, StreamKey stream);
  // Waits for the events of cached blocks and returns them all to the backend, but for
  // those of private streams.
  void release_cached();
  // Makes `stream`'s blocks its own (see above), or, with on = false, ordinary cached
  // blocks again.
  void set_private(StreamKey stream, bool on);

  BlockAllocatorStats stats() const;
  static size_t round_size(size_t bytes);
  // The largest cached block that may serve a request of `rounded` bytes.
  static size_t max_reuse_size(size_t rounded);

 private:
  struct Block {
    size_t size = 0;
    StreamKey stream;                     // owning stream
    bool in_use = false;
    std::vector<StreamKey> extra_uses;    // from record_stream, while in use
    EventRef owner_event;                 // recorded on `stream` when another stream asks
    std::vector<EventRef> use_events;     // recorded on extra_uses at free time
  };
  using Pool = std::multimap<size_t, void*>;  // size -> free block

  void* take_from_pool(Pool& pool, size_t size, bool other_stream);
  bool events_done(std::vector<EventRef>& events);
  bool event_done(EventRef& event);
  void release_cached_locked();
  size_t private_cached_locked() const;  // free bytes of private streams' pools
  [[noreturn]] void throw_out_of_memory(size_t requested, size_t rounded);

  BlockBackend& backend_;
  const std::string name_;
  const bool cross_stream_events_;
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;  // every block we own
  std::map<StreamKey, Pool> pools_;          // free blocks by owning stream
  std::set<StreamKey> private_streams_;
  BlockAllocatorStats stats_;
};

}  // namespace mtrain
