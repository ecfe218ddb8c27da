#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "data/dataloader.h"
#include "data/distributed_sampler.h"
#include "tests/data/traceable_dataset.h"

using namespace mtrain;
using namespace mtrain::data;
using Catch::Matchers::Contains;
using mtrain::testing::traceable_dataset;

namespace {

std::vector<Batch> drain(DataLoader& loader) {
  std::vector<Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

// Polls `pred` for up to 30 s; the bound only matters if the loader is broken.
template <class Pred>
bool eventually(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Returns a fixed list, e.g. one with an out-of-range index to make a worker throw.
class ListSampler final : public Sampler {
 public:
  explicit ListSampler(std::vector<int64_t> list) : list_(std::move(list)) {}
  std::vector<int64_t> indices() const override { return list_; }
  int64_t size() const override { return static_cast<int64_t>(list_.size()); }
  std::string describe() const override { return "fixed list"; }
  std::vector<int64_t> list_;
};

}  // namespace

TEST_CASE("DataLoader yields every sample exactly once per epoch", "[data][loader]") {
  const auto ds = traceable_dataset(103);
  const bool drop_last = GENERATE(false, true);
  DataLoader loader(ds, std::make_shared<RandomSampler>(103, 5),
                    {.batch_size = 10, .drop_last = drop_last, .num_workers = 2});
  CHECK(loader.num_batches() == (drop_last ? 10 : 11));
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    loader.start_epoch(epoch);
    const std::vector<Batch> batches = drain(loader);
    REQUIRE(static_cast<int64_t>(batches.size()) == loader.num_batches());
    std::vector<int64_t> seen;
    for (size_t k = 0; k < batches.size(); ++k) {
      const Batch& b = batches[k];
      CHECK(b.batch_index == static_cast<int64_t>(k));
      CHECK(b.epoch == epoch);
      CHECK(b.size() == (k == 10 ? 3 : 10));
      REQUIRE(b.images.shape() == Shape{b.size(), 2, 3, 4});
      REQUIRE(b.labels.shape() == Shape{b.size()});
      REQUIRE(b.labels.dtype() == DType::Int64);
      const float* img = b.images.data<float>();
      for (int64_t r = 0; r < b.size(); ++r) {
        const int64_t index = b.indices[static_cast<size_t>(r)];
        seen.push_back(index);
        CHECK(b.labels.data<int64_t>()[r] == index % 10);
        // The row holds this index's pixels (the first two spell the index).
        CHECK(img[r * 24] == static_cast<float>(index % 256) / 255.0f);
        CHECK(img[r * 24 + 1] == static_cast<float>(index / 256) / 255.0f);
        CHECK(img[r * 24 + 23] == static_cast<float>(ds->image(index)[23]) / 255.0f);
      }
    }
    std::sort(seen.begin(), seen.end());
    CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());  // no repeats
    CHECK(seen.size() == (drop_last ? 100u : 103u));
    CHECK(seen.back() <= 102);
    CHECK(!loader.next().has_value());  // stays finished
  }
}

TEST_CASE("DataLoader batches do not depend on the number of workers", "[data][loader]") {
  const auto ds = traceable_dataset(250);
  auto run = [&](int workers) {
    DataLoader loader(ds, std::make_shared<RandomSampler>(250, 11),
                      {.batch_size = 16, .num_workers = workers, .prefetch_depth = 4});
    std::vector<Batch> all;
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      loader.start_epoch(epoch);
      for (Batch& b : drain(loader)) all.push_back(std::move(b));
    }
    return all;
  };
  const std::vector<Batch> one = run(1);
  const std::vector<Batch> three = run(3);
  REQUIRE(one.size() == three.size());
  REQUIRE(one.size() == 32);
  for (size_t k = 0; k < one.size(); ++k) {
    CHECK(one[k].indices == three[k].indices);
    REQUIRE(one[k].images.nbytes() == three[k].images.nbytes());
    CHECK(std::memcmp(one[k].images.raw_data(), three[k].images.raw_data(),
                      one[k].images.nbytes()) == 0);
    CHECK(one[k].labels.to_vector<int64_t>() == three[k].labels.to_vector<int64_t>());
  }
  CHECK(one[0].indices != one[16].indices);  // epochs differ (set_epoch reached the sampler)
}

TEST_CASE("DataLoader prefetches up to prefetch_depth batches ahead of the consumer",
          "[data][loader]") {
  const auto ds = traceable_dataset(100);
  DataLoader loader(ds, std::make_shared<SequentialSampler>(100),
                    {.batch_size = 10, .num_workers = 2, .prefetch_depth = 3});
  CHECK(loader.batches_produced() == 0);  // nothing before an epoch starts
  loader.start_epoch(0);
  // Without any next() call, the workers fill the look-ahead window...
  REQUIRE(eventually([&] { return loader.batches_produced() == 3; }));
  // ...and stop there.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(loader.batches_produced() == 3);
  // Taking one batch makes room for exactly one more.
  auto first = loader.next();
  REQUIRE(first.has_value());
  CHECK(first->batch_index == 0);
  REQUIRE(eventually([&] { return loader.batches_produced() == 4; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(loader.batches_produced() == 4);
}

TEST_CASE("DataLoader starts an epoch at a later batch without assembling the ones before it",
          "[data][loader]") {
  const auto ds = traceable_dataset(103);
  const Augmentation augment{.crop_padding = 1, .horizontal_flip = true, .seed = 9};
  const auto loader_for = [&] {
    return std::make_unique<DataLoader>(ds, std::make_shared<RandomSampler>(103, 5),
                                        DataLoaderOptions{.batch_size = 10, .num_workers = 2, .augment = augment});
  };
  const auto whole = loader_for();
  whole->start_epoch(1);
  const std::vector<Batch> all = drain(*whole);
  REQUIRE(all.size() == 11);

  const auto resumed = loader_for();
  resumed->start_epoch(1, 4);
  const std::vector<Batch> rest = drain(*resumed);
  REQUIRE(rest.size() == 7);
  for (size_t k = 0; k < rest.size(); ++k) {
    const Batch& expected = all[k + 4];
    CHECK(rest[k].batch_index == expected.batch_index);
    CHECK(rest[k].indices == expected.indices);
    REQUIRE(rest[k].images.nbytes() == expected.images.nbytes());
    CHECK(std::memcmp(rest[k].images.raw_data(), expected.images.raw_data(), expected.images.nbytes()) == 0);
  }
  CHECK(resumed->batches_produced() == 7);  // batches 0-3 were never assembled

  // Past the end: an epoch with nothing left; then a whole epoch again.
  resumed->start_epoch(2, 11);
  CHECK_FALSE(resumed->next().has_value());
  resumed->start_epoch(2, 50);
  CHECK_FALSE(resumed->next().has_value());
  resumed->start_epoch(2);
  CHECK(drain(*resumed).size() == 11);
  CHECK_THROWS_WITH(resumed->start_epoch(2, -1), Contains("expected a first batch >= 0, found -1"));
}

TEST_CASE("DataLoader scales pixels to [0, 1] and normalises per channel", "[data][loader]") {
  // Two channels with pixels 0 and 255 in each, so both ends of the range are seen.
  std::vector<uint8_t> pixels = {0, 255, 51, 102, /* channel 1: */ 255, 0, 204, 153};
  auto ds = std::make_shared<const Dataset>("two-channel", "test", ImageShape{2, 2, 2}, 10,
                                            pixels, std::vector<int64_t>{3});
  auto first_batch = [&](DataLoaderOptions options) {
    DataLoader loader(ds, std::make_shared<SequentialSampler>(1), std::move(options));
    loader.start_epoch(0);
    return loader.next()->images.to_vector<float>();
  };

  SECTION("default: ToTensor semantics") {
    const auto v = first_batch({.batch_size = 4});
    REQUIRE(v.size() == 8);
    CHECK(v[0] == 0.0f);
    CHECK(v[1] == 1.0f);
    CHECK(v[2] == Approx(0.2f));
    CHECK(v[3] == Approx(0.4f));
    CHECK(*std::min_element(v.begin(), v.end()) >= 0.0f);
    CHECK(*std::max_element(v.begin(), v.end()) <= 1.0f);
  }
  SECTION("one mean/std for every channel") {
    const auto v = first_batch({.batch_size = 4, .mean = {0.5f}, .std = {0.25f}});
    for (size_t k = 0; k < 8; ++k) {
      CHECK(v[k] == Approx((pixels[k] / 255.0f - 0.5f) / 0.25f));
    }
    CHECK(v[0] == Approx(-2.0f));
    CHECK(v[1] == Approx(2.0f));
  }
  SECTION("per-channel mean/std") {
    const auto v = first_batch({.batch_size = 4, .mean = {0.1f, 0.9f}, .std = {0.5f, 2.0f}});
    for (size_t k = 0; k < 4; ++k) CHECK(v[k] == Approx((pixels[k] / 255.0f - 0.1f) / 0.5f));
    for (size_t k = 4; k < 8; ++k) CHECK(v[k] == Approx((pixels[k] / 255.0f - 0.9f) / 2.0f));
  }
}

TEST_CASE("DataLoader shuts down cleanly when the consumer stops early", "[data][loader]") {
  const auto ds = traceable_dataset(2000);
  // Each case would hang in the destructor (and hit the CTest timeout) if the workers
  // were not told to stop or waited for room that never comes.
  SECTION("destroyed without ever starting an epoch") {
    DataLoader loader(ds, std::make_shared<SequentialSampler>(2000), {.num_workers = 3});
  }
  SECTION("destroyed with a full prefetch window after one batch") {
    DataLoader loader(ds, std::make_shared<RandomSampler>(2000, 1),
                      {.batch_size = 8, .num_workers = 3, .prefetch_depth = 2});
    loader.start_epoch(0);
    REQUIRE(loader.next().has_value());
    REQUIRE(eventually([&] { return loader.batches_produced() == 3; }));
  }
  SECTION("an abandoned epoch is replaced cleanly by the next one") {
    DataLoader loader(ds, std::make_shared<RandomSampler>(2000, 1),
                      {.batch_size = 100, .num_workers = 3, .prefetch_depth = 4});
    loader.start_epoch(0);
    REQUIRE(loader.next().has_value());
    loader.start_epoch(1);
    const std::vector<Batch> batches = drain(loader);
    REQUIRE(batches.size() == 20);
    RandomSampler reference(2000, 1);
    reference.set_epoch(1);
    std::vector<int64_t> order;
    for (const Batch& b : batches) {
      CHECK(b.epoch == 1);
      order.insert(order.end(), b.indices.begin(), b.indices.end());
    }
    CHECK(order == reference.indices());
  }
}

TEST_CASE("DataLoader rethrows a worker's exception in the consumer", "[data][loader]") {
  const auto ds = traceable_dataset(50);
  std::vector<int64_t> list(40);
  for (int64_t i = 0; i < 40; ++i) list[static_cast<size_t>(i)] = i;
  list[25] = 50;  // out of range: batch 2 (items 20..29) fails to assemble
  auto sampler = std::make_shared<ListSampler>(list);
  DataLoader loader(ds, sampler, {.batch_size = 10, .num_workers = 3, .prefetch_depth = 4});
  loader.start_epoch(0);
  REQUIRE(loader.next()->batch_index == 0);
  REQUIRE(loader.next()->batch_index == 1);
  CHECK_THROWS_MATCHES(loader.next(), InternalError,
                       Catch::Matchers::Predicate<InternalError>([](const InternalError& e) {
                         const std::string m = e.what();
                         return m.find("sampler 'fixed list' produced index 50 (epoch 0, batch 2) "
                                       "for dataset traceable of 50 items") != std::string::npos;
                       }));
  // The epoch is over: asking again reports the same error instead of skipping ahead.
  CHECK_THROWS_AS(loader.next(), InternalError);

  // A fixed sampler and a new epoch recover.
  sampler->list_[25] = 25;
  loader.start_epoch(1);
  CHECK(drain(loader).size() == 4);
}

TEST_CASE("DataLoader rejects bad options and misuse", "[data][loader]") {
  const auto ds = traceable_dataset(10);
  auto sampler = std::make_shared<SequentialSampler>(10);
  CHECK_THROWS_AS(DataLoader(ds, sampler, {.batch_size = 0}), InvalidArgument);
  CHECK_THROWS_AS(DataLoader(ds, sampler, {.num_workers = 0}), InvalidArgument);
  CHECK_THROWS_AS(DataLoader(ds, sampler, {.prefetch_depth = 0}), InvalidArgument);
  CHECK_THROWS_AS(DataLoader(ds, sampler, {.mean = {0.5f}, .std = {}}), InvalidArgument);
  CHECK_THROWS_AS(DataLoader(ds, sampler, {.mean = {0.5f}, .std = {0.0f}}), InvalidArgument);
  CHECK_THROWS_AS(DataLoader(ds, sampler, {.mean = {0.1f, 0.2f, 0.3f}, .std = {1, 1, 1}}),
                  InvalidArgument);
  CHECK_THROWS_AS(DataLoader(ds, nullptr, {}), InvalidArgument);

  DataLoader loader(ds, sampler, {.batch_size = 4});
  CHECK_THROWS_AS(loader.next(), InternalError);  // no start_epoch yet
  CHECK_THAT(loader.describe(), Contains("batch 4"));
}

TEST_CASE("DataLoader follows per-step batch sizes, handing out 0-row batches", "[data][loader]") {
  const auto ds = traceable_dataset(10);
  auto sampler = std::make_shared<ListSampler>(std::vector<int64_t>{5, 6, 7, 2});
  const int workers = GENERATE(1, 3);
  DataLoader loader(ds, sampler, {.num_workers = workers, .batch_sizes = {2, 0, 1, 0, 1}});
  CHECK(loader.num_batches() == 5);
  CHECK_THAT(loader.describe(), Contains("5 per-step batch sizes"));
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    loader.start_epoch(epoch);
    const std::vector<Batch> batches = drain(loader);
    REQUIRE(batches.size() == 5u);
    const std::vector<std::vector<int64_t>> expected{{5, 6}, {}, {7}, {}, {2}};
    for (size_t k = 0; k < batches.size(); ++k) {
      const Batch& b = batches[k];
      CHECK(b.batch_index == static_cast<int64_t>(k));
      CHECK(b.indices == expected[k]);
      REQUIRE(b.images.shape() == Shape{b.size(), 2, 3, 4});
      REQUIRE(b.labels.shape() == Shape{b.size()});
      for (int64_t r = 0; r < b.size(); ++r) {
        CHECK(b.labels.data<int64_t>()[r] == b.indices[static_cast<size_t>(r)] % 10);
      }
    }
  }

  SECTION("an epoch of only empty steps still yields every step") {
    DataLoader empty(ds, std::make_shared<ListSampler>(std::vector<int64_t>{}),
                     {.batch_sizes = {0, 0, 0}});
    empty.start_epoch(0);
    const std::vector<Batch> batches = drain(empty);
    REQUIRE(batches.size() == 3u);
    for (const Batch& b : batches) CHECK(b.images.shape() == Shape{0, 2, 3, 4});
  }
}

TEST_CASE("DataLoader rejects per-step batch sizes that do not fit", "[data][loader]") {
  const auto ds = traceable_dataset(10);
  auto sampler = std::make_shared<SequentialSampler>(4);
  CHECK_THROWS_AS(DataLoader(ds, sampler, {.batch_sizes = {2, -1, 3}}), InvalidArgument);
  CHECK_THROWS_AS(DataLoader(ds, sampler, {.drop_last = true, .batch_sizes = {4}}),
                  InvalidArgument);
  DataLoader loader(ds, sampler, {.batch_sizes = {2, 1}});
  CHECK_THROWS_WITH(loader.start_epoch(0),
                    Contains("sum to the 4 items") && Contains("found a sum of 3"));
}

namespace {

// Two channels of 3x4 images; no pixel is 0, so padding shows.
std::shared_ptr<const Dataset> small_colour_set(int64_t n) {
  std::vector<uint8_t> pixels;
  std::vector<int64_t> labels;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < 2 * 12; ++k) pixels.push_back(static_cast<uint8_t>((i * 7 + k * 3) % 251 + 1));
    labels.push_back(i % 3);
  }
  return std::make_shared<const Dataset>("colour", "test", ImageShape{2, 3, 4}, 3, std::move(pixels),
                                         std::move(labels));
}

// The augmented image by the book: pad with zeros, cut at (top, left), mirror.
std::vector<float> by_hand(const Dataset& ds, int64_t index, int64_t pad, const AugmentationDraw& d) {
  const int64_t h = ds.height(), w = ds.width();
  const int64_t ph = h + 2 * pad, pw = w + 2 * pad;
  std::vector<float> out;
  for (int64_t c = 0; c < ds.channels(); ++c) {
    std::vector<uint8_t> padded(static_cast<size_t>(ph * pw), 0);
    for (int64_t y = 0; y < h; ++y) {
      for (int64_t x = 0; x < w; ++x) padded[static_cast<size_t>((y + pad) * pw + x + pad)] = ds.image(index)[(c * h + y) * w + x];
    }
    std::vector<uint8_t> crop;
    for (int64_t y = 0; y < h; ++y) {
      for (int64_t x = 0; x < w; ++x) crop.push_back(padded[static_cast<size_t>((y + d.top) * pw + x + d.left)]);
    }
    for (int64_t y = 0; y < h; ++y) {
      for (int64_t x = 0; x < w; ++x) {
        const int64_t sx = d.flip ? w - 1 - x : x;
        out.push_back(static_cast<float>(crop[static_cast<size_t>(y * w + sx)]) / 255.0f);
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("random crop and flip give the padded, cut and mirrored image of each draw", "[data][loader][augment]") {
  const auto ds = small_colour_set(40);
  DataLoaderOptions o;
  o.batch_size = 40;
  o.augment = {.crop_padding = 2, .horizontal_flip = true, .seed = 9};
  DataLoader loader(ds, std::make_shared<SequentialSampler>(ds->size()), o);
  CHECK_THAT(loader.describe(), Contains("random crop (padding 2), random horizontal flip"));
  loader.start_epoch(3);
  const auto batch = loader.next();
  REQUIRE(batch);
  int flips = 0, crops = 0;
  for (int64_t r = 0; r < batch->size(); ++r) {
    const AugmentationDraw d = augmentation_draw(o.augment, 3, r);
    flips += d.flip;
    crops += d.top != 2 || d.left != 2;
    CHECK(d.top >= 0);
    CHECK(d.top <= 4);
    CHECK(d.left <= 4);
    const std::vector<float> expected = by_hand(*ds, r, 2, d);
    const float* got = batch->images.data<float>() + r * 24;
    CHECK(std::vector<float>(got, got + 24) == expected);
  }
  // 40 draws: both flips and off-centre crops occur.
  CHECK(flips > 5);
  CHECK(flips < 35);
  CHECK(crops > 20);
}

TEST_CASE("augmentation draws: same seed same stream, whatever the workers; a new draw each epoch",
          "[data][loader][augment]") {
  const auto ds = small_colour_set(64);
  const auto run = [&](int workers, uint64_t seed, int64_t epoch) {
    DataLoaderOptions o;
    o.batch_size = 8;
    o.num_workers = workers;
    o.augment = {.crop_padding = 1, .horizontal_flip = true, .seed = seed};
    DataLoader loader(ds, std::make_shared<RandomSampler>(ds->size(), 4), o);
    loader.start_epoch(epoch);
    std::vector<float> all;
    while (auto b = loader.next()) {
      const float* p = b->images.data<float>();
      all.insert(all.end(), p, p + b->images.numel());
    }
    return all;
  };
  const auto a = run(1, 7, 0);
  CHECK(run(3, 7, 0) == a);
  CHECK(run(1, 7, 1) != a);
  CHECK(run(1, 8, 0) != a);
  // Over many images every offset and both flips turn up.
  std::set<int64_t> tops;
  int flips = 0;
  const Augmentation aug{.crop_padding = 4, .horizontal_flip = true, .seed = 1};
  for (int64_t i = 0; i < 2000; ++i) {
    const auto d = augmentation_draw(aug, 0, i);
    tops.insert(d.top);
    flips += d.flip;
  }
  CHECK(tops.size() == 9);
  CHECK(flips > 900);
  CHECK(flips < 1100);
  // Two ranks' shards of one epoch draw two different streams: the draws follow the
  // images, and the ranks hold different images.
  const auto stream = [&](int rank) {
    DistributedSampler shard(2000, rank, 2, /*shuffle=*/true, /*seed=*/1, /*drop_last=*/false);
    shard.set_epoch(0);
    std::vector<std::tuple<int64_t, int64_t, bool>> draws;
    for (int64_t i : shard.indices()) {
      const auto d = augmentation_draw(aug, 0, i);
      draws.emplace_back(d.top, d.left, d.flip);
    }
    return draws;
  };
  const auto rank0 = stream(0), rank1 = stream(1);
  REQUIRE(rank0.size() == rank1.size());
  int64_t same = 0;
  for (size_t i = 0; i < rank0.size(); ++i) same += rank0[i] == rank1[i];
  CHECK(same < static_cast<int64_t>(rank0.size()) / 20);  // 1 in 162 by chance
  // Flip alone keeps the image where it is.
  const auto d = augmentation_draw({.crop_padding = -1, .horizontal_flip = true, .seed = 1}, 0, 0);
  CHECK(d.top == 0);
  CHECK(d.left == 0);
}

TEST_CASE("augmentation refusals and the training set's channel statistics", "[data][loader][augment]") {
  const auto ds = small_colour_set(4);
  DataLoaderOptions o;
  o.augment.crop_padding = 5;
  CHECK_THROWS_WITH(DataLoader(ds, std::make_shared<SequentialSampler>(4), o),
                    Contains("expected a crop padding of at most 4 (the side of colour's images), found 5"));
  const ChannelStats s = channel_stats(*ds);
  REQUIRE(s.mean.size() == 2);
  for (int64_t c = 0; c < 2; ++c) {
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t k = 0; k < 12; ++k) sum += ds->image(i)[c * 12 + k] / 255.0;
    }
    const double mean = sum / 48;
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t k = 0; k < 12; ++k) sq += std::pow(ds->image(i)[c * 12 + k] / 255.0 - mean, 2);
    }
    CHECK(s.mean[static_cast<size_t>(c)] == Approx(mean).epsilon(1e-6));
    CHECK(s.std[static_cast<size_t>(c)] == Approx(std::sqrt(sq / 48)).epsilon(1e-6));
  }
}
