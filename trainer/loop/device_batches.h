// DeviceBatches: the batches of a DataLoader on the device the model trains on, the one place
// that knows where batches go (Note [Batches to the device] in device_batches.cpp). On the CPU the
// loader's tensors pass through untouched; on a GPU the images and labels arrive on the device,
// ordered on the caller's current stream. Indices, epoch and batch index pass through. One
// consumer thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "data/dataloader.h"
#include "data/device_prefetcher.h"
#include "tensor/tensor.h"

namespace mtrain {

class DeviceBatches {
 public:
  // `loader` must outlive this object. Throws InvalidArgument for a GPU that cannot be
  // used (see DevicePrefetcher).
  DeviceBatches(data::DataLoader& loader, Device device);

  // DataLoader::start_epoch: the batches before `first_batch` are passed over.
  void start_epoch(int64_t epoch, int64_t first_batch = 0);
  // The next batch of the epoch with images and labels on the device; nullopt at the end.
  std::optional<data::Batch> next();
  int64_t num_batches() const { return loader_.num_batches(); }
  Device device() const { return device_; }

 private:
  data::DataLoader& loader_;
  Device device_;
  std::unique_ptr<data::DevicePrefetcher> prefetcher_;  // on a GPU only
};

}  // namespace mtrain
