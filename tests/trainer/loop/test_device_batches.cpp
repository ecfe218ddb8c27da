// DeviceBatches (trainer/loop/device_batches.h) and the device list of the epoch line
// (trainer/setup/device.h) on the CPU; the GPU copies run in test_train_cuda.
#include <catch2/catch.hpp>

#include <memory>

#include "data/dataloader.h"
#include "data/sampler.h"
#include "data/synthetic.h"
#include "tests/support/solo_group.h"
#include "trainer/loop/device_batches.h"
#include "trainer/setup/device.h"

using namespace mtrain;

TEST_CASE("on the CPU DeviceBatches hands out exactly the loader's batches", "[device]") {
  auto dataset = std::make_shared<const data::Dataset>(data::make_synthetic_dataset(10, 1, "synthetic"));
  data::DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 1;
  data::DataLoader reference(dataset, std::make_shared<data::SequentialSampler>(dataset->size()), o);
  data::DataLoader loader(dataset, std::make_shared<data::SequentialSampler>(dataset->size()), o);
  DeviceBatches batches(loader, Device::cpu());
  CHECK(batches.num_batches() == 3);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    reference.start_epoch(epoch);
    batches.start_epoch(epoch);
    int64_t seen = 0;
    while (auto expected = reference.next()) {
      auto batch = batches.next();
      REQUIRE(batch.has_value());
      CHECK(batch->images.device() == Device::cpu());
      CHECK(batch->images.to_vector<float>() == expected->images.to_vector<float>());
      CHECK(batch->labels.to_vector<int64_t>() == expected->labels.to_vector<int64_t>());
      CHECK(batch->indices == expected->indices);
      CHECK(batch->batch_index == expected->batch_index);
      CHECK(batch->epoch == epoch);
      ++seen;
    }
    CHECK_FALSE(batches.next().has_value());
    CHECK(seen == 3);
  }
}

TEST_CASE("the epoch line's device list names every rank's device", "[device]") {
  TrainingDevice cpu;
  cpu.binding.device = Device::cpu(0);
  CHECK(all_rank_devices(nullptr, cpu) == std::vector<std::string>{"cpu"});
  TrainingDevice gpu;
  gpu.binding.device = Device::cuda(3);
  CHECK(all_rank_devices(nullptr, gpu) == std::vector<std::string>{"cuda:3"});
  // Over a group: the all-gathered list, CPU ranks by global rank.
  testing::SoloGroup solo;
  CHECK(all_rank_devices(solo.group.get(), cpu) == std::vector<std::string>{"cpu:0"});
  CHECK(all_rank_devices(solo.group.get(), gpu) == std::vector<std::string>{"cuda:3"});
}
