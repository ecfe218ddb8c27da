#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "data/dataloader.h"
#include "data/distributed_sampler.h"
#include "data/random.h"

using namespace mtrain;
using namespace mtrain::data;
using Catch::Matchers::Contains;
using Indices = std::vector<int64_t>;

namespace {

// n 1x1 images whose pixel is their index, labels index mod 3.
std::shared_ptr<const Dataset> tiny_dataset(int64_t n) {
  std::vector<uint8_t> pixels(static_cast<size_t>(n));
  Indices labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    pixels[static_cast<size_t>(i)] = static_cast<uint8_t>(i);
    labels[static_cast<size_t>(i)] = i % 3;
  }
  return std::make_shared<const Dataset>("tiny", "test fixture", ImageShape{1, 1, 1}, 3, std::move(pixels),
                                         std::move(labels));
}

std::vector<Indices> shards(int64_t n, int world, bool shuffle, uint64_t seed, bool drop_last,
                            int64_t epoch = 0) {
  std::vector<Indices> out;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(n, r, world, shuffle, seed, drop_last);
    s.set_epoch(epoch);
    const Indices shard = s.indices();
    CHECK(static_cast<int64_t>(shard.size()) == s.size());
    out.push_back(shard);
  }
  return out;
}

// The values of `p` at the given positions: expected shuffled shards are written as
// positions of the epoch's permutation, read off the formulas by hand.
Indices at(const Indices& p, const Indices& positions) {
  Indices out;
  for (int64_t i : positions) out.push_back(p.at(static_cast<size_t>(i)));
  return out;
}

std::map<int64_t, int> counts(const std::vector<Indices>& lists) {
  std::map<int64_t, int> c;
  for (const Indices& l : lists) {
    for (int64_t i : l) ++c[i];
  }
  return c;
}

}  // namespace

TEST_CASE("DistributedSampler without shuffle: exact PyTorch shards", "[data][distributed]") {
  // N=10, W=3: num_samples = ceil(10/3) = 4, total 12, padded list 0..9,0,1, interleaved.
  CHECK(shards(10, 3, false, 0, false) ==
        std::vector<Indices>{{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}});
  // drop_last: num_samples = floor(10/3) = 3, total 9, the list is cut to 0..8.
  CHECK(shards(10, 3, false, 0, true) == std::vector<Indices>{{0, 3, 6}, {1, 4, 7}, {2, 5, 8}});
  // N=7, W=4: ceil = 2, total 8, padded 0..6,0.
  CHECK(shards(7, 4, false, 0, false) == std::vector<Indices>{{0, 4}, {1, 5}, {2, 6}, {3, 0}});
  CHECK(shards(7, 4, false, 0, true) == std::vector<Indices>{{0}, {1}, {2}, {3}});
  // N=2, W=5: padding 3 > N, so the whole list repeats: 0,1,0,1,0.
  CHECK(shards(2, 5, false, 0, false) == std::vector<Indices>{{0}, {1}, {0}, {1}, {0}});
  // drop_last with N < W leaves every rank empty (floor(2/5) = 0).
  CHECK(shards(2, 5, false, 0, true) == std::vector<Indices>(5));
  // Divisible: drop_last changes nothing.
  CHECK(shards(6, 3, false, 0, false) == std::vector<Indices>{{0, 3}, {1, 4}, {2, 5}});
  CHECK(shards(6, 3, false, 0, true) == shards(6, 3, false, 0, false));
  CHECK(shards(0, 2, false, 0, false) == std::vector<Indices>(2));
  CHECK(shards(5, 1, false, 0, false) == std::vector<Indices>{{0, 1, 2, 3, 4}});

  DistributedSampler padded(10, 1, 3, false, 0, false);
  CHECK(padded.size() == 4);
  CHECK(padded.total_size() == 12);
  CHECK_THAT(padded.describe(), Contains("2 padded"));
  CHECK_THAT(DistributedSampler(10, 1, 3, false, 0, true).describe(), Contains("last 1 dropped"));
}

TEST_CASE("DistributedSampler with shuffle: shards of the permutation seed + epoch",
          "[data][distributed]") {
  const uint64_t seed = 17;
  const int64_t epoch = GENERATE(0, 3);
  INFO("epoch " << epoch);
  const Indices p10 = random_permutation(10, seed + static_cast<uint64_t>(epoch));
  CHECK(shards(10, 3, true, seed, false, epoch) ==
        std::vector<Indices>{at(p10, {0, 3, 6, 9}), at(p10, {1, 4, 7, 0}), at(p10, {2, 5, 8, 1})});
  CHECK(shards(10, 3, true, seed, true, epoch) ==
        std::vector<Indices>{at(p10, {0, 3, 6}), at(p10, {1, 4, 7}), at(p10, {2, 5, 8})});

  const Indices p7 = random_permutation(7, seed + static_cast<uint64_t>(epoch));
  CHECK(shards(7, 4, true, seed, false, epoch) ==
        std::vector<Indices>{at(p7, {0, 4}), at(p7, {1, 5}), at(p7, {2, 6}), at(p7, {3, 0})});
  CHECK(shards(7, 4, true, seed, true, epoch) ==
        std::vector<Indices>{at(p7, {0}), at(p7, {1}), at(p7, {2}), at(p7, {3})});

  const Indices p2 = random_permutation(2, seed + static_cast<uint64_t>(epoch));
  CHECK(shards(2, 5, true, seed, false, epoch) ==
        std::vector<Indices>{at(p2, {0}), at(p2, {1}), at(p2, {0}), at(p2, {1}), at(p2, {0})});
}

TEST_CASE("DistributedSampler: set_epoch reshuffles identically on every rank",
          "[data][distributed]") {
  const int64_t n = 103;
  const int world = 4;
  const auto epoch0 = shards(n, world, true, 5, false, 0);
  const auto epoch1 = shards(n, world, true, 5, false, 1);
  CHECK(epoch0 != epoch1);
  for (size_t r = 0; r < static_cast<size_t>(world); ++r) CHECK(epoch0[r] != epoch1[r]);
  // Two samplers of one rank built separately agree, so ranks need not communicate.
  CHECK(shards(n, world, true, 5, false, 1) == epoch1);
  // seed + epoch is what counts.
  CHECK(shards(n, world, true, 6, false, 0) == epoch1);
  // Without shuffle the epoch does not matter.
  CHECK(shards(n, world, false, 5, false, 0) == shards(n, world, false, 5, false, 7));
}

TEST_CASE("DistributedSampler: the ranks' union is the padded epoch", "[data][distributed]") {
  const auto [n, world] = GENERATE(table<int64_t, int>({{103, 4}, {10, 3}, {100, 4}, {3, 8}}));
  INFO("n " << n << ", world " << world);
  const Indices p = random_permutation(n, 9);
  const int64_t total = (n + world - 1) / world * world;

  // Not drop_last: every index once, plus the first total - n of the permutation once more
  // (wrapping around when the padding exceeds n).
  std::map<int64_t, int> expected;
  for (int64_t i = 0; i < n; ++i) expected[i] = 1;
  for (int64_t k = 0; k < total - n; ++k) ++expected[p[static_cast<size_t>(k % n)]];
  CHECK(counts(shards(n, world, true, 9, false)) == expected);

  // drop_last: the first floor(n/W)*W of the permutation, once each.
  std::map<int64_t, int> kept;
  for (int64_t k = 0; k < n / world * world; ++k) kept[p[static_cast<size_t>(k)]] = 1;
  CHECK(counts(shards(n, world, true, 9, true)) == kept);
}

TEST_CASE("DistributedSampler::resume_epoch: another world shards the rest, every item once",
          "[data][distributed]") {
  const int64_t n = 103, batch = 4, steps = 5;
  for (const bool drop_last : {false, true}) {
    for (const int new_world : {1, 2, 3, 5}) {
      INFO("drop_last " << drop_last << ", 2 ranks then " << new_world);
      // Two ranks take 5 steps of 4 images each in epoch 3.
      std::multiset<int64_t> seen;
      for (int r = 0; r < 2; ++r) {
        DistributedSampler old(n, r, 2, /*shuffle=*/true, /*seed=*/9, drop_last);
        old.set_epoch(3);
        const Indices shard = old.indices();
        seen.insert(shard.begin(), shard.begin() + steps * batch);
      }
      // The new world continues epoch 3 after the 40 items the old one took.
      Indices counts;
      for (int r = 0; r < new_world; ++r) {
        DistributedSampler next(n, r, new_world, true, 9, drop_last);
        next.resume_epoch(3, steps * batch * 2);
        next.set_epoch(3);
        const Indices shard = next.indices();
        CHECK(static_cast<int64_t>(shard.size()) == next.size());
        counts.push_back(next.size());
        seen.insert(shard.begin(), shard.end());
        // Other epochs are whole epochs.
        next.set_epoch(4);
        DistributedSampler plain(n, r, new_world, true, 9, drop_last);
        plain.set_epoch(4);
        CHECK(next.indices() == plain.indices());
      }
      // Every rank the same number of items: the ranks stay in lock step.
      CHECK(std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end());
      const int64_t rest = n - steps * batch * 2;
      const int64_t padded = drop_last ? rest / new_world * new_world : (rest + new_world - 1) / new_world * new_world;
      CHECK(static_cast<int64_t>(seen.size()) == steps * batch * 2 + padded);
      // Each item once, but for the padding of the rest (or its dropped tail).
      int64_t missing = 0, repeated = 0;
      for (int64_t i = 0; i < n; ++i) {
        missing += seen.count(i) == 0;
        repeated += seen.count(i) > 1 ? static_cast<int64_t>(seen.count(i)) - 1 : 0;
      }
      CHECK(missing == (drop_last ? rest - padded : 0));
      CHECK(repeated == (drop_last ? 0 : padded - rest));
    }
  }
  SECTION("a prefix as long as the epoch leaves nothing") {
    DistributedSampler s(10, 0, 3, true, 1, false);
    s.resume_epoch(0, 12);  // the old world's padding included
    s.set_epoch(0);
    CHECK(s.size() == 0);
    CHECK(s.indices().empty());
    CHECK_THROWS_WITH(s.resume_epoch(0, -1), Contains("found epoch 0 and -1 consumed"));
  }
}

TEST_CASE("EvalShardSampler visits every index exactly once over the ranks",
          "[data][distributed]") {
  auto eval_shards = [](int64_t n, int world) {
    std::vector<Indices> out;
    for (int r = 0; r < world; ++r) {
      EvalShardSampler s(n, r, world);
      s.set_epoch(4);  // no effect: evaluation order is fixed
      CHECK(static_cast<int64_t>(s.indices().size()) == s.size());
      out.push_back(s.indices());
    }
    return out;
  };
  CHECK(eval_shards(10, 3) == std::vector<Indices>{{0, 3, 6, 9}, {1, 4, 7}, {2, 5, 8}});
  CHECK(eval_shards(7, 4) == std::vector<Indices>{{0, 4}, {1, 5}, {2, 6}, {3}});
  CHECK(eval_shards(2, 5) == std::vector<Indices>{{0}, {1}, {}, {}, {}});
  CHECK(eval_shards(0, 2) == std::vector<Indices>{{}, {}});

  for (int64_t n : {1, 9, 10, 101}) {
    for (int world : {1, 2, 3, 7}) {
      const auto all = eval_shards(n, world);
      std::map<int64_t, int> once;
      for (int64_t i = 0; i < n; ++i) once[i] = 1;
      CHECK(counts(all) == once);
      for (const Indices& s : all) CHECK(s.size() + 1 >= all.front().size());  // differ by <= 1
    }
  }
  CHECK_THAT(EvalShardSampler(10, 2, 3).describe(), Contains("unpadded"));
}

TEST_CASE("split_global_batch is torch.chunk-like", "[data][distributed]") {
  CHECK(split_global_batch(30, 4) == Indices{8, 8, 8, 6});
  CHECK(split_global_batch(25, 4) == Indices{7, 7, 7, 4});
  CHECK(split_global_batch(2, 4) == Indices{1, 1, 0, 0});
  CHECK(split_global_batch(9, 4) == Indices{3, 3, 3, 0});
  CHECK(split_global_batch(6, 3) == Indices{2, 2, 2});
  CHECK(split_global_batch(5, 1) == Indices{5});
  CHECK_THROWS_WITH(split_global_batch(0, 4), Contains("expected a global batch >= 1, found 0"));
  CHECK_THROWS_WITH(split_global_batch(8, 0), Contains("expected a world size >= 1, found 0"));
}

TEST_CASE("GlobalBatchShardSampler without shuffle: exact chunks", "[data][distributed]") {
  auto shard = [](int rank, int64_t g, bool drop_last) {
    GlobalBatchShardSampler s(10, rank, 3, g, false, 0, drop_last);
    CHECK(static_cast<int64_t>(s.indices().size()) == s.size());
    return std::make_pair(s.indices(), s.batch_sizes());
  };
  // G=5 on 3 ranks: chunks 2,2,1 of [0..4] and [5..9].
  CHECK(shard(0, 5, false) == std::make_pair(Indices{0, 1, 5, 6}, Indices{2, 2}));
  CHECK(shard(1, 5, false) == std::make_pair(Indices{2, 3, 7, 8}, Indices{2, 2}));
  CHECK(shard(2, 5, false) == std::make_pair(Indices{4, 9}, Indices{1, 1}));
  // G=4: [0..3] -> 2,2,0; [4..7] -> 2,2,0; the partial [8,9] -> 1,1,0.
  CHECK(shard(0, 4, false) == std::make_pair(Indices{0, 1, 4, 5, 8}, Indices{2, 2, 1}));
  CHECK(shard(1, 4, false) == std::make_pair(Indices{2, 3, 6, 7, 9}, Indices{2, 2, 1}));
  CHECK(shard(2, 4, false) == std::make_pair(Indices{}, Indices{0, 0, 0}));
  // drop_last drops the partial global batch [8, 9].
  CHECK(shard(0, 4, true) == std::make_pair(Indices{0, 1, 4, 5}, Indices{2, 2}));
  CHECK(shard(1, 4, true) == std::make_pair(Indices{2, 3, 6, 7}, Indices{2, 2}));
  CHECK(shard(2, 4, true) == std::make_pair(Indices{}, Indices{0, 0}));
  CHECK_THAT(GlobalBatchShardSampler(10, 0, 3, 4, false, 0, true).describe(),
             Contains("dropped"));
}

TEST_CASE("GlobalBatchShardSampler: the ranks' chunks of a step are the 1-rank global batch",
          "[data][distributed]") {
  const auto [n, world, g] =
      GENERATE(table<int64_t, int, int64_t>({{103, 3, 10}, {103, 4, 25}, {50, 3, 7}, {9, 4, 2},
                                             {20, 3, 30}, {12, 3, 6}}));
  const bool shuffle = GENERATE(false, true);
  const bool drop_last = GENERATE(false, true);
  const int64_t epoch = 2;
  INFO("n " << n << ", world " << world << ", G " << g << ", shuffle " << shuffle
            << ", drop_last " << drop_last);

  GlobalBatchShardSampler single(n, 0, 1, g, shuffle, 11, drop_last);
  single.set_epoch(epoch);
  const Indices global = single.indices();
  const Indices global_steps = single.batch_sizes();

  std::vector<Indices> rank_indices;
  std::vector<Indices> rank_steps;
  for (int r = 0; r < world; ++r) {
    GlobalBatchShardSampler s(n, r, world, g, shuffle, 11, drop_last);
    s.set_epoch(epoch);
    rank_indices.push_back(s.indices());
    rank_steps.push_back(s.batch_sizes());
    REQUIRE(rank_steps.back().size() == global_steps.size());  // same step count everywhere
  }

  std::vector<size_t> cursor(static_cast<size_t>(world), 0);
  int64_t global_cursor = 0;
  for (size_t step = 0; step < global_steps.size(); ++step) {
    Indices joined;
    for (size_t r = 0; r < static_cast<size_t>(world); ++r) {
      const auto first = rank_indices[r].begin() + static_cast<int64_t>(cursor[r]);
      joined.insert(joined.end(), first, first + rank_steps[r][step]);
      cursor[r] += static_cast<size_t>(rank_steps[r][step]);
    }
    const auto first = global.begin() + global_cursor;
    CHECK(joined == Indices(first, first + global_steps[step]));
    CHECK(rank_steps[0][step] == split_global_batch(global_steps[step], world)[0]);
    global_cursor += global_steps[step];
  }
  CHECK(global_cursor == static_cast<int64_t>(global.size()));
  for (size_t r = 0; r < static_cast<size_t>(world); ++r) {
    CHECK(cursor[r] == rank_indices[r].size());
  }
  CHECK(global.size() == static_cast<size_t>(drop_last ? n / g * g : n));
}

TEST_CASE("GlobalBatchShardSampler drives a DataLoader in lock step on every rank",
          "[data][distributed]") {
  const int64_t n = 10;
  const auto ds = tiny_dataset(n);
  // G=4 on 3 ranks: rank 2 never gets a sample but must take all 3 steps.
  std::vector<Indices> seen;
  for (int r = 0; r < 3; ++r) {
    auto sampler = std::make_shared<GlobalBatchShardSampler>(n, r, 3, 4, true, 1, false);
    DataLoader loader(ds, sampler, {.num_workers = 1, .batch_sizes = sampler->batch_sizes()});
    loader.start_epoch(0);
    Indices rows;
    Indices all;
    while (auto b = loader.next()) {
      rows.push_back(b->size());
      all.insert(all.end(), b->indices.begin(), b->indices.end());
    }
    CHECK(rows == sampler->batch_sizes());
    CHECK(all == sampler->indices());
    seen.push_back(rows);
  }
  CHECK(seen == std::vector<Indices>{{2, 2, 1}, {2, 2, 1}, {0, 0, 0}});
}

TEST_CASE("Distributed samplers reject bad arguments, saying expected vs found",
          "[data][distributed]") {
  CHECK_THROWS_WITH(DistributedSampler(10, 3, 3, false, 0, false),
                    Contains("expected a rank in [0, 3)") && Contains("found 3"));
  CHECK_THROWS_WITH(DistributedSampler(10, -1, 3, false, 0, false), Contains("found -1"));
  CHECK_THROWS_WITH(DistributedSampler(10, 0, 0, false, 0, false),
                    Contains("expected a world size >= 1, found 0"));
  CHECK_THROWS_WITH(DistributedSampler(-2, 0, 1, false, 0, false),
                    Contains("expected a dataset size >= 0, found -2"));
  CHECK_THROWS_AS(EvalShardSampler(10, 2, 2), InvalidArgument);
  CHECK_THROWS_AS(EvalShardSampler(-1, 0, 2), InvalidArgument);
  CHECK_THROWS_AS(GlobalBatchShardSampler(10, 4, 4, 8, false, 0, false), InvalidArgument);
  CHECK_THROWS_WITH(GlobalBatchShardSampler(10, 0, 4, 0, false, 0, false),
                    Contains("expected a global batch size >= 1, found 0"));
  CHECK_THROWS_AS(GlobalBatchShardSampler(10, 0, -1, 8, false, 0, false), InvalidArgument);
}

TEST_CASE("apportion: proportional integer shares that sum to the total", "[data][distributed][balance]") {
  // 2:1 speeds.
  CHECK(apportion(90, {2, 1}, 1) == Indices{60, 30});
  // Largest remainders: 10 by 1:1:1 -> 3.33 each, the leftover to the lowest rank (a tie).
  CHECK(apportion(10, {1, 1, 1}, 1) == Indices{4, 3, 3});
  CHECK(apportion(5, {7, 7}, 0) == Indices{3, 2});
  // A larger remainder wins over a lower rank: 10 by 1:2 -> 3.33, 6.67.
  CHECK(apportion(10, {1, 2}, 0) == Indices{3, 7});
  // The minimum: 1000:1 of 10 would leave rank 1 with 0.
  CHECK(apportion(10, {1000, 1}, 0) == Indices{10, 0});
  CHECK(apportion(10, {1000, 1}, 1) == Indices{9, 1});
  CHECK(apportion(10, {1000, 1, 1}, 2) == Indices{6, 2, 2});
  // Weight 0: nothing, whatever the minimum (7.5 and 2.5: the tie goes to the lower rank).
  CHECK(apportion(10, {3, 0, 1}, 1) == Indices{8, 0, 2});
  // Too few items for the minimum: proportional without it.
  CHECK(apportion(2, {1, 1, 1}, 1) == Indices{1, 1, 0});
  CHECK(apportion(0, {1, 2}, 1) == Indices{0, 0});
  // Speeds near int64's top do not overflow (products are 128-bit).
  CHECK(apportion(1'000'000, {1'000'000'000'000'000'000, 500'000'000'000'000'000}, 1) == Indices{666667, 333333});
  for (int64_t total = 0; total < 40; ++total) {
    const Indices s = apportion(total, {5, 3, 11, 1}, 1);
    CHECK(std::accumulate(s.begin(), s.end(), int64_t{0}) == total);
    if (total >= 4) CHECK(*std::min_element(s.begin(), s.end()) >= 1);
  }
  CHECK_THROWS_WITH(apportion(10, {0, 0}, 1), Contains("at least one weight > 0"));
  CHECK_THROWS_WITH(apportion(10, {1, -1}, 1), Contains("expected weights >= 0, found -1"));
  CHECK_THROWS_WITH(apportion(-1, {1}, 0), Contains("found total -1"));
  CHECK_THROWS_WITH(apportion(1, {}, 0), Contains("0 weights"));
}

namespace {

// Every rank's sampler of one job, with the same share changes applied.
std::vector<GlobalBatchShardSampler> ranks_of(int64_t n, int world, int64_t g, bool drop_last) {
  std::vector<GlobalBatchShardSampler> out;
  for (int r = 0; r < world; ++r) out.emplace_back(n, r, world, g, true, 5, drop_last);
  return out;
}

// Checks that the ranks' chunks of every step tile the 1-rank global batch of that step,
// and returns every rank's step sizes.
std::vector<Indices> check_tiling(std::vector<GlobalBatchShardSampler>& ranks, int64_t n, int64_t g, bool drop_last,
                                  int64_t epoch) {
  GlobalBatchShardSampler single(n, 0, 1, g, true, 5, drop_last);
  single.set_epoch(epoch);
  const Indices global = single.indices();
  std::vector<Indices> indices;
  std::vector<Indices> steps;
  for (auto& s : ranks) {
    indices.push_back(s.indices());
    steps.push_back(s.batch_sizes());
    REQUIRE(static_cast<int64_t>(indices.back().size()) == s.size());
    REQUIRE(steps.back().size() == single.batch_sizes().size());
  }
  std::vector<int64_t> cursor(ranks.size(), 0);
  int64_t global_cursor = 0;
  for (size_t step = 0; step < steps[0].size(); ++step) {
    Indices joined;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const auto first = indices[r].begin() + cursor[r];
      joined.insert(joined.end(), first, first + steps[r][step]);
      cursor[r] += steps[r][step];
      CHECK(steps[r][step] == ranks[0].chunks(static_cast<int64_t>(step))[r]);
    }
    const int64_t size = single.batch_sizes()[step];
    CHECK(joined == Indices(global.begin() + global_cursor, global.begin() + global_cursor + size));
    // What every rank's reducer is told the step holds (MicroBatchInfo::world_samples).
    for (const auto& s : ranks) CHECK(s.step_size(static_cast<int64_t>(step)) == size);
    global_cursor += size;
  }
  CHECK(global_cursor == static_cast<int64_t>(global.size()));
  return steps;
}

}  // namespace

TEST_CASE("GlobalBatchShardSampler: shares changed mid-epoch still tile every global batch",
          "[data][distributed][balance]") {
  // Note [Shares that change mid-epoch]
  const bool drop_last = GENERATE(false, true);
  const int64_t n = 103, g = 10;
  auto ranks = ranks_of(n, 3, g, drop_last);
  for (auto& s : ranks) {
    s.set_epoch(1);
    s.set_shares(0, {4, 4, 2});
    s.set_shares(3, {6, 3, 1});
    s.set_shares(7, {1, 1, 8});
  }
  const std::vector<Indices> steps = check_tiling(ranks, n, g, drop_last, 1);
  CHECK(steps[0][0] == 4);
  CHECK(steps[0][2] == 4);
  CHECK(steps[0][3] == 6);
  CHECK(steps[2][6] == 1);
  CHECK(steps[2][7] == 8);
  if (!drop_last) {
    // The partial last batch of 3 images, in proportion to 1:1:8 with at least one each.
    CHECK(ranks[0].chunks(10) == Indices{1, 1, 1});
  }
  CHECK(ranks[1].shares() == Indices{1, 1, 8});
  CHECK_THAT(ranks[0].describe(), Contains("shares 1,1,8"));
  // A later change from the same step replaces the earlier one.
  for (auto& s : ranks) s.set_shares(7, {2, 2, 6});
  CHECK(check_tiling(ranks, n, g, drop_last, 1)[2][7] == 6);
  // The next epoch starts with the latest shares throughout.
  for (auto& s : ranks) s.set_epoch(2);
  const std::vector<Indices> next = check_tiling(ranks, n, g, drop_last, 2);
  CHECK(next[0][0] == 2);
  CHECK(next[2][0] == 6);
}

TEST_CASE("GlobalBatchShardSampler::set_shares rejects shares of another length or sum", "[data][distributed][balance]") {
  GlobalBatchShardSampler s(20, 0, 2, 8, false, 0, false);
  CHECK_THROWS_WITH(s.set_shares(0, {4, 3}), Contains("expected 2 shares summing to 8") && Contains("summing to 7"));
  CHECK_THROWS_WITH(s.set_shares(0, {8}), Contains("found 1 summing to 8"));
  CHECK_THROWS_WITH(s.set_shares(0, {9, -1}), Contains("expected each >= 0, found -1"));
  CHECK_THROWS_WITH(s.set_shares(-1, {4, 4}), Contains("from step -1"));
  // Without set_shares the split is torch.chunk's.
  CHECK(s.shares() == Indices{4, 4});
  CHECK(s.chunks(2) == Indices{2, 2});
}

TEST_CASE("DataLoader::replan re-cuts the batches not yet handed out, whatever the workers had ready",
          "[data][distributed][balance]") {
  // Note [Re-planning an epoch]
  const int workers = GENERATE(1, 2, 3);
  const int64_t n = 60;
  const auto ds = tiny_dataset(n);
  INFO("workers " << workers);
  std::vector<std::vector<Indices>> batches(2);
  std::vector<std::shared_ptr<GlobalBatchShardSampler>> samplers;
  for (int r = 0; r < 2; ++r) {
    auto sampler = std::make_shared<GlobalBatchShardSampler>(n, r, 2, 6, true, 9, false);
    samplers.push_back(sampler);
    DataLoader loader(ds, sampler, {.num_workers = workers, .prefetch_depth = 3});
    loader.start_epoch(0);
    for (int k = 0; k < 2; ++k) batches[r].push_back(loader.next()->indices);
    // The workers have had time to assemble batches 2.. with the old split.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    sampler->set_shares(3, {5, 1});
    loader.replan(3);
    CHECK_THROWS_WITH(loader.replan(1), Contains("expected a batch not yet handed out (>= 2)") &&
                                            Contains("found batch 1"));
    while (auto b = loader.next()) batches[r].push_back(b->indices);
  }
  // Step by step, the two ranks' batches are the 1-rank global batch; steps 0..2 split 3,3,
  // the rest 5,1.
  GlobalBatchShardSampler single(n, 0, 1, 6, true, 9, false);
  const Indices global = single.indices();
  REQUIRE(batches[0].size() == 10);
  REQUIRE(batches[1].size() == 10);
  for (size_t step = 0; step < 10; ++step) {
    Indices joined = batches[0][step];
    joined.insert(joined.end(), batches[1][step].begin(), batches[1][step].end());
    CHECK(joined == Indices(global.begin() + 6 * static_cast<int64_t>(step),
                            global.begin() + 6 * static_cast<int64_t>(step) + 6));
    CHECK(batches[0][step].size() == (step < 3 ? 3u : 5u));
  }
}
