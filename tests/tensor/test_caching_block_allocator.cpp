// The caching allocators' bookkeeping against a fake backend: memory from malloc with a
// budget, events whose completion the test decides.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>
#include <vector>

#include "core/error.h"
#include "tensor/caching_block_allocator.h"

using namespace mtrain;

namespace {

class FakeBackend final : public BlockBackend {
 public:
  size_t budget = SIZE_MAX;  // bytes the "device" has
  size_t used = 0;
  int mallocs = 0;
  int frees = 0;
  std::map<void*, size_t> live;
  // Events: id -> (stream, completed). A recorded event completes when the test says so.
  struct FakeEvent {
    StreamKey stream;
    bool completed = false;
    bool released = false;
  };
  std::vector<FakeEvent> events;  // index + 1 = handle
  bool fail_record = false;

  void* allocate(size_t bytes) override {
    if (used + bytes > budget) return nullptr;
    void* p = std::malloc(bytes);
    used += bytes;
    live[p] = bytes;
    mallocs++;
    return p;
  }
  void free(void* ptr) override {
    REQUIRE(live.count(ptr) == 1);
    used -= live[ptr];
    live.erase(ptr);
    std::free(ptr);
    frees++;
  }
  EventRef record_event(StreamKey stream) override {
    if (fail_record) throw std::runtime_error("device lost");
    events.push_back(FakeEvent{stream});
    return EventRef{reinterpret_cast<void*>(events.size()), stream.device};
  }
  FakeEvent& event(EventRef e) { return events.at(reinterpret_cast<size_t>(e.handle) - 1); }
  bool event_completed(EventRef e) override {
    REQUIRE_FALSE(event(e).released);
    return event(e).completed;
  }
  void synchronize_event(EventRef e) override { event(e).completed = true; }
  void release_event(EventRef e) override {
    REQUIRE_FALSE(event(e).released);
    event(e).released = true;
  }
  std::string memory_summary() override { return "fake device has 0 B free"; }

  // Completes every event recorded on `stream` so far.
  void complete(StreamKey stream) {
    for (auto& e : events) {
      if (e.stream == stream) e.completed = true;
    }
  }
  ~FakeBackend() override {
    for (auto& [p, n] : live) std::free(p);
  }
};

constexpr StreamKey kStreamA{0, 1};
constexpr StreamKey kStreamB{0, 2};
constexpr StreamKey kSideStream{0, 3};

}  // namespace

TEST_CASE("sizes round to 512 B below 1 MiB and 256 KiB above") {
  CHECK(CachingBlockAllocator::round_size(0) == 512);
  CHECK(CachingBlockAllocator::round_size(1) == 512);
  CHECK(CachingBlockAllocator::round_size(512) == 512);
  CHECK(CachingBlockAllocator::round_size(513) == 1024);
  CHECK(CachingBlockAllocator::round_size((1 << 20) - 1) == (1 << 20));
  CHECK(CachingBlockAllocator::round_size((1 << 20) + 1) == (1 << 20) + (256 << 10));
  CHECK(CachingBlockAllocator::max_reuse_size(1024) == 2048);
  CHECK(CachingBlockAllocator::max_reuse_size(4 << 20) == (5 << 20));
}

TEST_CASE("the steady state reuses blocks on the same stream without a backend call") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  for (int step = 0; step < 5; ++step) {
    void* a = alloc.allocate(1000, kStreamA);
    void* b = alloc.allocate(3 << 20, kStreamA);
    void* c = alloc.allocate(1000, kStreamA);  // same size as a while a is live
    CHECK(a != c);
    alloc.deallocate(a);
    alloc.deallocate(b);
    alloc.deallocate(c);
  }
  // Same-stream reuse needs no event: none was recorded.
  CHECK(backend.events.empty());
  CHECK(backend.mallocs == 3);
  const auto s = alloc.stats();
  CHECK(s.backend_allocs == 3);
  CHECK(s.cache_hits == 12);
  CHECK(s.in_use_bytes == 0);
  CHECK(s.reserved_bytes == 1024 + (3 << 20) + 1024);
  CHECK(s.cached_bytes == s.reserved_bytes);
}

TEST_CASE("a cached block serves only requests it exceeds by the bounded factor") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* big = alloc.allocate(8 << 20, kStreamA);
  alloc.deallocate(big);
  void* small = alloc.allocate(1 << 20, kStreamA);  // 8x smaller: must not take the 8 MiB block
  CHECK(small != big);
  CHECK(backend.mallocs == 2);
  void* near = alloc.allocate(7 << 20, kStreamA);  // within 25%: reuses it
  CHECK(near == big);
  CHECK(alloc.stats().in_use_bytes == (8 << 20) + (1 << 20));
  alloc.deallocate(small);
  alloc.deallocate(near);
}

TEST_CASE("best fit: the smallest cached block that is large enough") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* b4 = alloc.allocate(4096, kStreamA);
  void* b2 = alloc.allocate(2048, kStreamA);
  void* b3 = alloc.allocate(3072, kStreamA);
  alloc.deallocate(b4);
  alloc.deallocate(b2);
  alloc.deallocate(b3);
  CHECK(alloc.allocate(2500, kStreamA) == b3);
  CHECK(alloc.allocate(1500, kStreamA) == b2);
  CHECK(alloc.allocate(4000, kStreamA) == b4);
}

TEST_CASE("another stream gets a freed block only after an event on the owning stream completes") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* a = alloc.allocate(1 << 20, kStreamA);
  alloc.deallocate(a);  // kernels on stream A may still use it
  CHECK(backend.events.empty());  // nothing recorded until another stream asks
  void* b = alloc.allocate(1 << 20, kStreamB);
  CHECK(b != a);
  CHECK(backend.mallocs == 2);
  REQUIRE(backend.events.size() == 1);  // recorded on A when B asked
  CHECK(backend.events[0].stream == kStreamA);
  alloc.deallocate(b);
  backend.complete(kStreamA);
  // Stream B's own block comes first (no event needed); take it, then A's moves over.
  void* b_again = alloc.allocate(1 << 20, kStreamB);
  CHECK(b_again == b);
  void* moved = alloc.allocate(1 << 20, kStreamB);
  CHECK(moved == a);
  CHECK(backend.mallocs == 2);
  // The moved block now belongs to stream B: freed there, it is B's at once...
  alloc.deallocate(moved);
  CHECK(alloc.allocate(1 << 20, kStreamB) == a);
  alloc.deallocate(a);
  // ...and A has to wait for B's free-time event.
  void* for_a = alloc.allocate(1 << 20, kStreamA);
  CHECK(for_a != a);
  CHECK(backend.mallocs == 3);
  for (auto& e : backend.events) {
    if (e.completed) CHECK(e.released);  // completed events go back to the backend
  }
}

TEST_CASE("record_stream keeps a block from every stream until the side stream is done") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* a = alloc.allocate(4096, kStreamA);
  alloc.record_stream(a, kSideStream);
  alloc.record_stream(a, kSideStream);  // recorded once
  alloc.record_stream(a, kStreamA);     // the owner itself: nothing to record
  alloc.deallocate(a);
  CHECK(backend.events.size() == 1);    // the side stream's; the owner's waits for a request
  void* next = alloc.allocate(4096, kStreamA);
  CHECK(next != a);  // even the owning stream must wait for the side stream
  backend.complete(kSideStream);
  void* reused = alloc.allocate(4096, kStreamA);
  CHECK(reused == a);
  // The extra use ended with the free: the next free records no side-stream event.
  alloc.deallocate(reused);
  CHECK(backend.events.size() == 1);
  alloc.deallocate(next);
}

TEST_CASE("record_stream on something that is not a live block is an internal error") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  int not_ours = 0;
  CHECK_THROWS_AS(alloc.record_stream(&not_ours, kStreamA), InternalError);
  void* a = alloc.allocate(64, kStreamA);
  alloc.deallocate(a);
  CHECK_THROWS_AS(alloc.record_stream(a, kStreamA), InternalError);
}

TEST_CASE("without cross-stream events (pinned memory) only declared uses hold a block") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "pinned", /*cross_stream_events=*/false);
  const StreamKey host{-1, 0};
  void* a = alloc.allocate(4096, host);
  alloc.deallocate(a);
  CHECK(backend.events.empty());
  void* b = alloc.allocate(4096, host);
  CHECK(b == a);
  alloc.record_stream(b, kStreamA);  // an asynchronous copy reads it
  alloc.deallocate(b);
  CHECK(alloc.allocate(4096, host) != a);
  backend.complete(kStreamA);
  CHECK(alloc.allocate(4096, host) == a);
}

TEST_CASE("out of memory: cached blocks are returned and the request retried") {
  FakeBackend backend;
  backend.budget = 8 << 20;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* a = alloc.allocate(3 << 20, kStreamA);
  void* b = alloc.allocate(3 << 20, kStreamB);
  alloc.deallocate(a);
  alloc.deallocate(b);  // 6 MiB cached, events pending on both streams
  void* big = alloc.allocate(6 << 20, kStreamA);  // only fits once the cache is gone
  REQUIRE(big != nullptr);
  const auto s = alloc.stats();
  CHECK(s.backend_frees == 2);
  CHECK(s.reserved_bytes == (6 << 20));
  CHECK(s.cached_bytes == 0);
  CHECK(backend.used == (6 << 20));
  for (auto& e : backend.events) CHECK(e.released);  // synchronised, then released
  alloc.deallocate(big);
}

TEST_CASE("out of memory after the retry is a clear error with the numbers") {
  FakeBackend backend;
  backend.budget = 4 << 20;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* a = alloc.allocate(3 << 20, kStreamA);
  try {
    alloc.allocate(2 << 20, kStreamA);
    FAIL("expected out of memory");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains("fake:0: out of memory allocating 2.00 MiB (2097152 bytes"));
    CHECK_THAT(msg, Catch::Contains("3.00 MiB in use by live tensors"));
    CHECK_THAT(msg, Catch::Contains("3.00 MiB reserved after returning every cached block"));
    CHECK_THAT(msg, Catch::Contains("fake device has 0 B free"));
  }
  // The failed request changed nothing.
  CHECK(alloc.stats().in_use_bytes == (3 << 20));
  alloc.deallocate(a);
  CHECK(alloc.stats().in_use_bytes == 0);
}

TEST_CASE("a block whose free-time event cannot be recorded is never reused") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* a = alloc.allocate(4096, kStreamA);
  alloc.record_stream(a, kSideStream);  // its free must record an event on the side stream
  backend.fail_record = true;
  alloc.deallocate(a);  // must not throw
  backend.fail_record = false;
  CHECK(alloc.stats().reserved_bytes == 0);
  CHECK(alloc.allocate(4096, kStreamB) != a);
}

TEST_CASE("an owner event that cannot be recorded fails the request and leaves the block to its stream") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* a = alloc.allocate(4096, kStreamA);
  alloc.deallocate(a);
  backend.fail_record = true;
  CHECK_THROWS_WITH(alloc.allocate(4096, kStreamB), "device lost");
  backend.fail_record = false;
  CHECK(alloc.allocate(4096, kStreamA) == a);  // the owner reuses it without an event
  alloc.deallocate(a);
}

TEST_CASE("release_cached waits for the owning stream before returning a block") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* a = alloc.allocate(2048, kStreamA);
  alloc.deallocate(a);
  CHECK(backend.events.empty());
  alloc.release_cached();
  REQUIRE(backend.events.size() == 1);
  CHECK(backend.events[0].stream == kStreamA);
  CHECK(backend.events[0].completed);  // synchronised before the free
  CHECK(backend.events[0].released);
  CHECK(backend.live.empty());
}

TEST_CASE("release_cached returns every free block and keeps live ones") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  void* live = alloc.allocate(1 << 20, kStreamA);
  void* a = alloc.allocate(2048, kStreamA);
  void* b = alloc.allocate(2048, kStreamB);
  alloc.deallocate(a);
  alloc.deallocate(b);
  alloc.release_cached();
  CHECK(backend.live.size() == 1);
  CHECK(backend.live.count(live) == 1);
  const auto s = alloc.stats();
  CHECK(s.reserved_bytes == (1 << 20));
  CHECK(s.in_use_bytes == (1 << 20));
  CHECK(s.cached_bytes == 0);
  alloc.deallocate(live);
}

TEST_CASE("a private stream's blocks serve it alone and outlive release_cached") {
  FakeBackend backend;
  CachingBlockAllocator alloc(backend, "fake:0");
  alloc.set_private(kSideStream, true);
  void* graph = alloc.allocate(1 << 20, kSideStream);
  alloc.deallocate(graph);
  backend.complete(kSideStream);
  // Another stream never takes it, even with the owner's work done...
  void* other = alloc.allocate(1 << 20, kStreamA);
  CHECK(other != graph);
  CHECK(backend.events.empty());  // not even asked: no event on the private stream
  alloc.deallocate(other);
  // ...nor does release_cached (or an out-of-memory retry) return it.
  alloc.release_cached();
  CHECK(backend.live.count(graph) == 1);
  CHECK(backend.live.count(other) == 0);
  CHECK(alloc.stats().cached_bytes == (1 << 20));
  CHECK(alloc.stats().private_cached_bytes == (1 << 20));
  // Its own stream takes it back; a private stream may still take others' blocks.
  void* again = alloc.allocate(1 << 20, kSideStream);
  CHECK(again == graph);
  void* a = alloc.allocate(2048, kStreamA);
  alloc.deallocate(a);
  void* first = alloc.allocate(2048, kSideStream);  // A's block waits for an event on A
  CHECK(first != a);
  backend.complete(kStreamA);
  CHECK(alloc.allocate(2048, kSideStream) == a);
  alloc.deallocate(a);
  alloc.deallocate(first);
  // Made ordinary again, its blocks are cached blocks like any other.
  alloc.deallocate(again);
  CHECK(alloc.stats().private_cached_bytes == (1 << 20) + 2 * 2048);
  alloc.set_private(kSideStream, false);
  CHECK(alloc.stats().private_cached_bytes == 0);
  alloc.release_cached();
  CHECK(backend.live.empty());
  CHECK(alloc.stats().reserved_bytes == 0);
}

TEST_CASE("format_bytes") {
  CHECK(format_bytes(512) == "512 B");
  CHECK(format_bytes(1536) == "1.50 KiB");
  CHECK(format_bytes(size_t(3) << 30) == "3.00 GiB");
}
