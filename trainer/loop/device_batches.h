// The batches of a DataLoader on the device the model trains on.
//
// Note [Batches to the device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The training loop and the evaluation read every batch through DeviceBatches, the one
// place that knows where batches go. On the CPU it hands the loader's tensors through
// untouched (no copy, so CPU runs are bit-for-bit what they were). On a GPU it reads
// through a DevicePrefetcher (data/device_prefetcher.h, Note [Device prefetch]): batch
// k+1 is copied to the GPU on a stream of its own while step k runs, and the step's
// kernels are ordered after the copy on the GPU, not by blocking the host. The copy
// overlaps only from pinned host memory, so a loader that feeds a GPU is built with
// pin_memory (train_command.cpp). Indices, epoch and batch index pass through.
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

  void start_epoch(int64_t epoch);
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
