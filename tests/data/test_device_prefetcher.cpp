// Pinned batches and DevicePrefetcher (Note [Device prefetch]), registered per tag:
//   [unit]  everywhere: pin_memory and the prefetcher refuse clearly without a usable GPU
//           (with one, pinned batches equal unpinned ones);
//   [gpu]   the prefetcher yields exactly the loader's batches on the device (values,
//           order, labels, indices, epochs, the last partial batch, empty batches and
//           epochs), rethrows the loader's errors in place, survives an abandoned epoch.
// The gpu cases skip the whole binary without a usable GPU.
#include <catch2/catch.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/dataloader.h"
#include "tests/data/traceable_dataset.h"
#include "data/device_prefetcher.h"
#include "tensor/cuda_devices.h"
#include "tests/support/skip.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/stream.h"
#endif

using namespace mtrain;
using namespace mtrain::data;
using Catch::Matchers::Contains;
using mtrain::testing::traceable_dataset;

namespace {

const Device kGpu = Device::cuda(0);

// A fixed order, e.g. empty, or with an index out of range to make a worker throw.
class ListSampler final : public Sampler {
 public:
  explicit ListSampler(std::vector<int64_t> list) : list_(std::move(list)) {}
  std::vector<int64_t> indices() const override { return list_; }
  int64_t size() const override { return static_cast<int64_t>(list_.size()); }
  std::string describe() const override { return "fixed list"; }

 private:
  std::vector<int64_t> list_;
};

DataLoaderOptions options(int64_t batch_size, bool pin_memory) {
  DataLoaderOptions o;
  o.batch_size = batch_size;
  o.num_workers = 2;
  o.prefetch_depth = 2;
  o.mean = {0.25f, 0.5f};
  o.std = {0.5f, 2.0f};
  o.pin_memory = pin_memory;
  return o;
}

}  // namespace

TEST_CASE("pin_memory: refused without a usable GPU, else pinned batches equal unpinned ones",
          "[unit]") {
  auto dataset = traceable_dataset(10);
  auto sampler = std::make_shared<SequentialSampler>(10);
  if (cuda_info().device_count == 0) {
    CHECK_THROWS_AS(DataLoader(dataset, sampler, options(4, true)), InvalidArgument);
    CHECK_THROWS_WITH(DataLoader(dataset, sampler, options(4, true)),
                      Contains("pin_memory needs a usable GPU") && Contains(cuda_summary()) &&
                          Contains("leave pin_memory off"));
    CHECK_NOTHROW(DataLoader(dataset, sampler, options(4, false)));
    return;
  }
  DataLoader pinned(dataset, sampler, options(4, true));
  DataLoader pageable(dataset, std::make_shared<SequentialSampler>(10), options(4, false));
  CHECK_THAT(pinned.describe(), Contains("pinned"));
  CHECK_THAT(pageable.describe(), !Contains("pinned"));
  pinned.start_epoch(0);
  pageable.start_epoch(0);
  int64_t batches = 0;
  while (auto a = pinned.next()) {
    auto b = pageable.next();
    REQUIRE(b);
    CHECK(a->images.is_pinned());
    CHECK(a->labels.is_pinned());
    CHECK_FALSE(b->images.is_pinned());
    CHECK(a->images.shape() == b->images.shape());
    CHECK(a->images.to_vector<float>() == b->images.to_vector<float>());
    CHECK(a->labels.to_vector<int64_t>() == b->labels.to_vector<int64_t>());
    ++batches;
  }
  CHECK(batches == 3);
  CHECK_FALSE(pageable.next());
}

TEST_CASE("DevicePrefetcher: a CPU device, a missing GPU or no CUDA is a clear error", "[unit]") {
  DataLoader loader(traceable_dataset(4), std::make_shared<SequentialSampler>(4), options(2, false));
  CHECK_THROWS_WITH(DevicePrefetcher(loader, Device::cpu()),
                    Contains("DevicePrefetcher: expected a GPU device, found cpu"));
  const Device missing = Device::cuda(cuda_info().device_count);  // one past the last GPU
  CHECK_THROWS_AS(DevicePrefetcher(loader, missing), InvalidArgument);
  CHECK_THROWS_WITH(DevicePrefetcher(loader, missing),
                    Contains("expected " + missing.str() + " to be a usable GPU") &&
                        Contains(cuda_summary()));
}

#ifdef MTRAIN_HAVE_CUDA

namespace {

void require_gpu() {
  if (cuda_info().device_count == 0) testing::skip_test_binary(cuda_summary().c_str());
}

// Every field of a prefetched batch against the loader's own batch.
void check_same_batch(const Batch& on_device, const Batch& expected) {
  INFO("epoch " << expected.epoch << ", batch " << expected.batch_index);
  CHECK(on_device.epoch == expected.epoch);
  CHECK(on_device.batch_index == expected.batch_index);
  CHECK(on_device.indices == expected.indices);
  CHECK(on_device.images.device() == kGpu);
  CHECK(on_device.labels.device() == kGpu);
  CHECK(on_device.images.shape() == expected.images.shape());
  CHECK(on_device.labels.shape() == expected.labels.shape());
  CHECK(on_device.images.dtype() == DType::Float32);
  CHECK(on_device.labels.dtype() == DType::Int64);
  // Read back through the current stream, which the prefetcher made wait for the copy.
  CHECK(on_device.images.to_vector<float>() == expected.images.to_vector<float>());
  CHECK(on_device.labels.to_vector<int64_t>() == expected.labels.to_vector<int64_t>());
}

}  // namespace

TEST_CASE("DevicePrefetcher: exactly the loader's batches on the GPU over two epochs", "[gpu]") {
  require_gpu();
  // 23 items in batches of 5: four full batches and a partial one of 3.
  auto dataset = traceable_dataset(23);
  for (const bool pin_memory : {true, false}) {
    DYNAMIC_SECTION("pin_memory " << pin_memory) {
      DataLoader reference(dataset, std::make_shared<RandomSampler>(23, 7), options(5, false));
      DataLoader loader(dataset, std::make_shared<RandomSampler>(23, 7), options(5, pin_memory));
      DevicePrefetcher prefetcher(loader, kGpu);
      CHECK(prefetcher.device() == kGpu);
      CHECK(prefetcher.num_batches() == 5);
      // The steps run on a stream of their own, as a training loop's may.
      cuda::OwnedStream steps(0);
      cuda::StreamGuard guard(steps.stream());
      std::vector<int64_t> first_indices;
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        reference.start_epoch(epoch);
        prefetcher.start_epoch(epoch);
        int64_t count = 0;
        while (auto expected = reference.next()) {
          std::optional<Batch> got = prefetcher.next();
          REQUIRE(got);
          check_same_batch(*got, *expected);
          if (count == 0 && epoch == 0) first_indices = got->indices;
          if (count == 0 && epoch == 1) CHECK(got->indices != first_indices);  // reshuffled
          ++count;
        }
        CHECK(count == 5);
        CHECK_FALSE(prefetcher.next());
        CHECK_FALSE(prefetcher.next());  // and stays at the end
      }
      // An epoch started at a later batch (a resumed run): the loader's batches from there.
      reference.start_epoch(1, 3);
      prefetcher.start_epoch(1, 3);
      int64_t count = 0;
      while (auto expected = reference.next()) {
        std::optional<Batch> got = prefetcher.next();
        REQUIRE(got);
        CHECK(got->batch_index == 3 + count);
        check_same_batch(*got, *expected);
        ++count;
      }
      CHECK(count == 2);
      CHECK_FALSE(prefetcher.next());
    }
  }
}

TEST_CASE("DevicePrefetcher: empty batches and an empty epoch", "[gpu]") {
  require_gpu();
  auto dataset = traceable_dataset(6);
  SECTION("an epoch without items ends at once") {
    DataLoader loader(dataset, std::make_shared<ListSampler>(std::vector<int64_t>{}), options(4, true));
    DevicePrefetcher prefetcher(loader, kGpu);
    CHECK(prefetcher.num_batches() == 0);
    prefetcher.start_epoch(0);
    CHECK_FALSE(prefetcher.next());
    prefetcher.start_epoch(1);
    CHECK_FALSE(prefetcher.next());
  }
  SECTION("a 0-row step gets empty device tensors, in its place") {
    DataLoaderOptions o = options(1, true);
    o.batch_sizes = {2, 0, 1};
    auto sampler = std::make_shared<ListSampler>(std::vector<int64_t>{5, 3, 1});
    DataLoader reference(dataset, sampler, o);
    DataLoader loader(dataset, sampler, o);
    DevicePrefetcher prefetcher(loader, kGpu);
    reference.start_epoch(0);
    prefetcher.start_epoch(0);
    for (const int64_t rows : {2, 0, 1}) {
      auto expected = reference.next();
      auto got = prefetcher.next();
      REQUIRE(expected);
      REQUIRE(got);
      CHECK(got->size() == rows);
      CHECK(got->images.shape() == Shape{rows, 2, 3, 4});
      check_same_batch(*got, *expected);
    }
    CHECK_FALSE(prefetcher.next());
  }
}

TEST_CASE("DevicePrefetcher: a loader error comes with its batch, after the batches before it",
          "[gpu]") {
  require_gpu();
  auto dataset = traceable_dataset(6);
  // Batch 2 holds index 99, out of range: its worker throws.
  auto sampler = std::make_shared<ListSampler>(std::vector<int64_t>{0, 1, 2, 3, 99, 5});
  DataLoader loader(dataset, sampler, options(2, true));
  DevicePrefetcher prefetcher(loader, kGpu);
  for (int attempt = 0; attempt < 2; ++attempt) {
    prefetcher.start_epoch(attempt);
    for (const int64_t k : {0, 1}) {
      auto batch = prefetcher.next();
      REQUIRE(batch);
      CHECK(batch->batch_index == k);
      CHECK(batch->labels.to_vector<int64_t>() ==
            std::vector<int64_t>{(2 * k) % 10, (2 * k + 1) % 10});
    }
    CHECK_THROWS_AS(prefetcher.next(), InternalError);
    CHECK_THROWS_WITH(prefetcher.next(), Contains("produced index 99"));  // until start_epoch
  }
}

TEST_CASE("DevicePrefetcher: an abandoned epoch leaves nothing behind", "[gpu]") {
  require_gpu();
  auto dataset = traceable_dataset(12);
  DataLoader reference(dataset, std::make_shared<RandomSampler>(12, 3), options(4, false));
  DataLoader loader(dataset, std::make_shared<RandomSampler>(12, 3), options(4, true));
  DevicePrefetcher prefetcher(loader, kGpu);
  prefetcher.start_epoch(0);
  REQUIRE(prefetcher.next());  // batch 1 is in flight now
  prefetcher.start_epoch(1);
  reference.start_epoch(1);
  int64_t count = 0;
  while (auto expected = reference.next()) {
    auto got = prefetcher.next();
    REQUIRE(got);
    CHECK(got->epoch == 1);
    check_same_batch(*got, *expected);
    ++count;
  }
  CHECK(count == 3);
  CHECK_FALSE(prefetcher.next());
}

#endif  // MTRAIN_HAVE_CUDA
