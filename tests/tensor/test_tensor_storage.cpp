// Tensor views and the caching host allocator.
#include <catch2/catch.hpp>

#include <vector>

#include "core/error.h"
#include "tensor/tensor.h"

using namespace mtrain;

TEST_CASE("views share storage with their base", "[tensor]") {
  Tensor base = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4});
  Tensor v = base.view({2, -1});
  CHECK(v.shape() == Shape{2, 6});
  CHECK(v.shares_storage_with(base));
  v.data<float>()[5] = 50.0f;
  CHECK(base.data<float>()[5] == 50.0f);
  CHECK_THROWS_AS(base.view({5, -1}), InternalError);

  Tensor copy = base.clone();
  CHECK_FALSE(copy.shares_storage_with(base));
  copy.data<float>()[0] = -1.0f;
  CHECK(base.data<float>()[0] == 0.0f);
}

TEST_CASE("view rejects negative sizes other than a single -1", "[tensor]") {
  const Tensor base = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {2, 3});
  // (-2) * (-3) == 6 == numel: only an explicit check tells this from a real shape.
  CHECK_THROWS_WITH(base.view({-2, -3}), Catch::Contains("expected dimensions >= 0 or one -1"));
  CHECK_THROWS_AS(base.view({-1, -1}), InternalError);
  CHECK(base.view({3, -1}).shape() == Shape{3, 2});
}

TEST_CASE("shapes whose size overflows are rejected, not wrapped", "[tensor]") {
  // 2^31 * 2^31 * 4 overflows int64; wrapped, it would allocate a few bytes for it.
  const int64_t big = int64_t{1} << 31;
  CHECK_THROWS_WITH(Tensor::empty({big, big, 4}), Catch::Contains("expected at most"));
  // The element count fits but the byte size does not.
  CHECK_THROWS_WITH(Tensor::empty({int64_t{1} << 62}), Catch::Contains("bytes"));
  CHECK_THROWS_WITH(Tensor::empty({2, -3}), Catch::Contains("expected dimensions >= 0, found -3"));
  float one = 1.0f;
  CHECK_THROWS_AS(Tensor::borrow(&one, {big, big, big}), InvalidArgument);
}

TEST_CASE("narrow0 and flat_view start at the right offset", "[tensor]") {
  Tensor base = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 2, 2});
  Tensor rows = base.narrow0(1, 2);
  CHECK(rows.shape() == Shape{2, 2, 2});
  CHECK(rows.numel() == 8);
  CHECK(rows.to_vector<float>() == std::vector<float>{4, 5, 6, 7, 8, 9, 10, 11});
  // A narrow of a narrow adds the offsets.
  CHECK(rows.narrow0(1, 1).to_vector<float>() == std::vector<float>{8, 9, 10, 11});
  rows.data<float>()[0] = 40.0f;
  CHECK(base.data<float>()[4] == 40.0f);
  CHECK_THROWS_AS(base.narrow0(2, 2), InternalError);

  Tensor flat = base.flat_view(3, {2, 3});
  CHECK(flat.to_vector<float>() == std::vector<float>{3, 40, 5, 6, 7, 8});
  flat.fill_(-1.0f);
  CHECK(base.data<float>()[2] == 2.0f);
  CHECK(base.data<float>()[3] == -1.0f);
  CHECK(base.data<float>()[8] == -1.0f);
  CHECK(base.data<float>()[9] == 9.0f);
  // A flat view of a narrowed tensor counts from the narrowed start.
  CHECK(rows.flat_view(6, {2}).to_vector<float>() == std::vector<float>{10, 11});
  CHECK_THROWS_AS(base.flat_view(10, {3}), InternalError);
  // Negative sizes and offsets near INT64_MAX must not slip through by wrapping.
  CHECK_THROWS_AS(base.flat_view(0, {-2, 3}), InvalidArgument);
  CHECK_THROWS_AS(base.flat_view(INT64_MAX, {2}), InternalError);
  CHECK_THROWS_AS(base.narrow0(1, INT64_MAX), InternalError);
}

TEST_CASE("the host allocator serves steady-state allocations from its cache", "[tensor]") {
  // The sizes of one "training step": activations, gradients, a batch.
  const std::vector<Shape> step_shapes = {{256, 6, 28, 28}, {256, 16, 10, 10}, {120, 400},
                                          {256, 1, 28, 28}, {256}, {7}};
  auto step = [&] {
    std::vector<Tensor> live;
    for (const Shape& s : step_shapes) live.push_back(Tensor::empty(s));
    // A temporary freed mid-step is reused by the next request of its size.
    Tensor tmp = Tensor::empty({256, 6, 28, 28});
    tmp = Tensor();
    live.push_back(Tensor::empty({256, 6, 28, 28}));
  };
  step();  // warm-up
  const AllocatorStats warm = host_allocator_stats();
  for (int i = 0; i < 5; ++i) step();
  const AllocatorStats after = host_allocator_stats();
  CHECK(after.system_allocs == warm.system_allocs);
  CHECK(after.cache_hits > warm.cache_hits);
  CHECK(after.in_use_bytes == warm.in_use_bytes);
}

TEST_CASE("a cached block is not reused for a request less than half its size", "[tensor]") {
  { Tensor big = Tensor::empty({1 << 20}); }  // 4 MiB back in the cache
  const uint64_t before = host_allocator_stats().system_allocs;
  Tensor small = Tensor::empty({1000});
  CHECK(host_allocator_stats().system_allocs == before + 1);
}
