#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "data/random.h"
#include "data/sampler.h"

using namespace mtrain::data;

namespace {

bool is_permutation_of_range(std::vector<int64_t> v, int64_t n) {
  if (static_cast<int64_t>(v.size()) != n) return false;
  std::sort(v.begin(), v.end());
  for (int64_t i = 0; i < n; ++i) {
    if (v[static_cast<size_t>(i)] != i) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("SequentialSampler visits 0..n-1 in order every epoch", "[data][sampler]") {
  SequentialSampler s(5);
  CHECK(s.size() == 5);
  CHECK(s.indices() == std::vector<int64_t>{0, 1, 2, 3, 4});
  s.set_epoch(3);
  CHECK(s.epoch() == 3);
  CHECK(s.indices() == std::vector<int64_t>{0, 1, 2, 3, 4});
  CHECK(SequentialSampler(0).indices().empty());
  CHECK_THROWS_AS(SequentialSampler(-1), mtrain::InvalidArgument);
}

TEST_CASE("RandomSampler: a permutation, reproducible for (seed, epoch)", "[data][sampler]") {
  RandomSampler a(1000, 42);
  RandomSampler b(1000, 42);
  a.set_epoch(2);
  b.set_epoch(2);
  const auto order = a.indices();
  CHECK(is_permutation_of_range(order, 1000));
  CHECK(order == b.indices());
  CHECK(order == a.indices());  // asking twice in one epoch gives the same list

  std::vector<int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  CHECK(order != identity);

  SECTION("a new epoch gives a new order") {
    a.set_epoch(3);
    const auto next = a.indices();
    CHECK(is_permutation_of_range(next, 1000));
    CHECK(next != order);
  }
  SECTION("seed + epoch is what counts (PyTorch's convention)") {
    RandomSampler shifted(1000, 43);
    shifted.set_epoch(1);
    CHECK(shifted.indices() == order);
    RandomSampler other_seed(1000, 7);
    other_seed.set_epoch(2);
    CHECK(other_seed.indices() != order);
  }
}

TEST_CASE("random_permutation is uniform enough: each position sees every value",
          "[data][sampler]") {
  // Over 2000 shuffles of 4 items, every (position, value) pair should appear about
  // 500 times; a biased shuffle (e.g. swapping with any index) would skew this.
  std::vector<std::vector<int>> hits(4, std::vector<int>(4, 0));
  for (uint64_t seed = 0; seed < 2000; ++seed) {
    const auto p = random_permutation(4, seed);
    for (size_t pos = 0; pos < 4; ++pos) ++hits[pos][static_cast<size_t>(p[pos])];
  }
  for (const auto& row : hits) {
    for (int h : row) CHECK((h > 400 && h < 600));
  }
}
