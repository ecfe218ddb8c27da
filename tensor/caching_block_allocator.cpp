#include "tensor/caching_block_allocator.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

#include "core/error.h"

namespace mtrain {

namespace {
constexpr size_t kSmallQuantum = 512;
constexpr size_t kLargeQuantum = 256 << 10;
constexpr size_t kLargeThreshold = 1 << 20;
}  // namespace

std::string format_bytes(size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {}", value, units[unit]);
}

size_t CachingBlockAllocator::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  const size_t quantum = bytes < kLargeThreshold ? kSmallQuantum : kLargeQuantum;
  return (bytes + quantum - 1) / quantum * quantum;
}

size_t CachingBlockAllocator::max_reuse_size(size_t rounded) {
  return rounded < kLargeThreshold ? 2 * rounded : rounded + rounded / 4;
}

CachingBlockAllocator::CachingBlockAllocator(BlockBackend& backend, std::string name,
                                             bool cross_stream_events)
    : backend_(backend), name_(std::move(name)), cross_stream_events_(cross_stream_events) {}

CachingBlockAllocator::~CachingBlockAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    release_cached_locked();
  } catch (const std::exception&) {
    // A destructor cannot report; the memory goes back with the process.
  }
}

bool CachingBlockAllocator::event_done(EventRef& event) {
  if (event.handle == nullptr) return true;
  if (!backend_.event_completed(event)) return false;
  backend_.release_event(event);
  event = EventRef{};
  return true;
}

bool CachingBlockAllocator::events_done(std::vector<EventRef>& events) {
  bool all = true;
  for (EventRef& e : events) all = event_done(e) && all;
  if (all) events.clear();
  return all;
}

// Best fit within the reuse bound among blocks whose events allow it (Note
// [Stream-ordered block reuse]). Querying an event is cheap; completed ones are
// released at once so each is queried until it completes, not on every request.
// A free block without an owner event has had none recorded since its free: one that
// completed was consumed by the move it allowed.
void* CachingBlockAllocator::take_from_pool(Pool& pool, size_t size, bool other_stream) {
  const size_t limit = max_reuse_size(size);
  for (auto it = pool.lower_bound(size); it != pool.end() && it->first <= limit; ++it) {
    Block& b = blocks_.at(it->second);
    if (!events_done(b.use_events)) continue;
    if (other_stream && cross_stream_events_ && b.owner_event.handle == nullptr) {
      b.owner_event = backend_.record_event(b.stream);
    }
    if (other_stream && !event_done(b.owner_event)) continue;
    void* ptr = it->second;
    pool.erase(it);
    return ptr;
  }
  return nullptr;
}

void* CachingBlockAllocator::allocate(size_t bytes, StreamKey stream) {
  if (bytes > SIZE_MAX / 2) {
    throw InvalidArgument(fmt::format("{}: cannot allocate {} bytes", name_, bytes));
  }
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* ptr = nullptr;
  if (auto own = pools_.find(stream); own != pools_.end()) {
    ptr = take_from_pool(own->second, size, false);
  }
  if (ptr == nullptr) {
    for (auto& [owner, pool] : pools_) {
      if (owner == stream || private_streams_.contains(owner)) continue;
      ptr = take_from_pool(pool, size, true);
      if (ptr != nullptr) break;
    }
  }
  if (ptr != nullptr) {
    Block& b = blocks_.at(ptr);
    // The owner event (if still held) orders a later cross-stream move after this
    // stream's use; the new owner records a fresh one when it frees the block.
    if (b.owner_event.handle != nullptr) {
      backend_.release_event(b.owner_event);
      b.owner_event = EventRef{};
    }
    b.stream = stream;
    b.in_use = true;
    stats_.cached_bytes -= b.size;
    stats_.in_use_bytes += b.size;
    stats_.cache_hits++;
    return ptr;
  }
  ptr = backend_.allocate(size);
  if (ptr == nullptr) {
    release_cached_locked();
    ptr = backend_.allocate(size);
    if (ptr == nullptr) throw_out_of_memory(bytes, size);
  }
  Block& b = blocks_[ptr];
  b.size = size;
  b.stream = stream;
  b.in_use = true;
  stats_.backend_allocs++;
  stats_.reserved_bytes += size;
  stats_.in_use_bytes += size;
  return ptr;
}

void CachingBlockAllocator::deallocate(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || !it->second.in_use) {
    // Not a live block of ours: memory corruption or a double free; continuing would
    // hand the same memory to two tensors.
    std::fprintf(stderr, "%s: deallocate(%p) of a block this allocator does not hold\n",
                 name_.c_str(), ptr);
    std::abort();
  }
  Block& b = it->second;
  b.in_use = false;
  stats_.in_use_bytes -= b.size;
  try {
    for (const StreamKey& use : b.extra_uses) b.use_events.push_back(backend_.record_event(use));
  } catch (const std::exception&) {
    // Without the events nobody can tell when the block is safe to reuse, so it is
    // never reused (nor freed: a kernel may still write to it). The same failure
    // surfaces at the next CUDA call, where it can be reported.
    stats_.reserved_bytes -= b.size;
    blocks_.erase(it);
    return;
  }
  b.extra_uses.clear();
  stats_.cached_bytes += b.size;
  pools_[b.stream].emplace(b.size, ptr);
}

void CachingBlockAllocator::record_stream(void* ptr, StreamKey stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || !it->second.in_use) {
    throw InternalError(fmt::format("{}: record_stream on {} which is not a live block", name_, ptr));
  }
  Block& b = it->second;
  if (stream == b.stream) return;
  for (const StreamKey& s : b.extra_uses) {
    if (s == stream) return;
  }
  b.extra_uses.push_back(stream);
}

void CachingBlockAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

void CachingBlockAllocator::set_private(StreamKey stream, bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  if (on) {
    private_streams_.insert(stream);
  } else {
    private_streams_.erase(stream);
  }
}

void CachingBlockAllocator::release_cached_locked() {
  for (auto& [owner, pool] : pools_) {
    if (private_streams_.contains(owner)) continue;
    // Erase as we go, so that a backend failure part way leaves consistent books.
    while (!pool.empty()) {
      void* ptr = pool.begin()->second;
      pool.erase(pool.begin());
      Block b = std::move(blocks_.at(ptr));
      blocks_.erase(ptr);
      stats_.reserved_bytes -= b.size;
      stats_.cached_bytes -= b.size;
      for (EventRef& e : b.use_events) {
        if (e.handle == nullptr) continue;  // already completed and released
        backend_.synchronize_event(e);
        backend_.release_event(e);
      }
      // The owning stream's last use of the block must be over before the memory goes.
      if (b.owner_event.handle == nullptr && cross_stream_events_) b.owner_event = backend_.record_event(b.stream);
      if (b.owner_event.handle != nullptr) {
        backend_.synchronize_event(b.owner_event);
        backend_.release_event(b.owner_event);
      }
      backend_.free(ptr);
      stats_.backend_frees++;
    }
  }
  std::erase_if(pools_, [](const auto& entry) { return entry.second.empty(); });
}

void CachingBlockAllocator::throw_out_of_memory(size_t requested, size_t rounded) {
  std::string device = backend_.memory_summary();
  const size_t kept = private_cached_locked();
  throw OutOfMemoryError(fmt::format(
      "{}: out of memory allocating {} ({} bytes, rounded to {}): {} in use by live tensors, {} "
      "reserved after returning every cached block{}{}{}; free tensors you no longer need or use "
      "a smaller batch",
      name_, format_bytes(requested), requested, format_bytes(rounded),
      format_bytes(stats_.in_use_bytes), format_bytes(stats_.reserved_bytes),
      kept > 0 ? fmt::format(" but the {} a CUDA graph keeps", format_bytes(kept)) : "",
      device.empty() ? "" : "; ", device));
}

size_t CachingBlockAllocator::private_cached_locked() const {
  size_t bytes = 0;
  for (const StreamKey& stream : private_streams_) {
    if (auto pool = pools_.find(stream); pool != pools_.end()) {
      for (const auto& [size, ptr] : pool->second) bytes += size;
    }
  }
  return bytes;
}

BlockAllocatorStats CachingBlockAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  BlockAllocatorStats s = stats_;
  s.private_cached_bytes = private_cached_locked();
  return s;
}

}  // namespace mtrain
