// DevicePrefetcher: a DataLoader's batches on a GPU, each copied there on a stream of its own
// while the step before it runs (Note [Device prefetch] in device_prefetcher.cpp).
//
//   DataLoader loader(dataset, sampler, {.batch_size = 64, .pin_memory = true});
//   DevicePrefetcher batches(loader, Device::cuda(0));
//   for (int64_t e = 0; e < epochs; ++e) {
//     batches.start_epoch(e);
//     while (auto batch = batches.next()) { ... }  // batch->images/labels on cuda:0
//   }
//
// A handed-out batch is ordered on the consumer's current stream (kernels queued afterwards read
// it once it has arrived; the host never waits). Only from pinned memory does the copy overlap.
// Everything else passes through (indices, epoch, batch_index, order, a partial or empty last
// batch). A loader error is rethrown by the next() after the batch before it, and by every call
// after that until start_epoch. next() and start_epoch must be called from one consumer thread,
// the one whose current stream runs the steps.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>

#include "data/dataloader.h"
#include "tensor/tensor.h"

namespace mtrain::data {

class DevicePrefetcher {
 public:
  // `loader` must outlive this object; `device` must be a usable GPU. Throws
  // InvalidArgument for a CPU device, a GPU that does not exist, and in a build or on a
  // machine without CUDA.
  DevicePrefetcher(DataLoader& loader, Device device);
  // Waits for the copy still in flight (the copy stream finishes its work).
  ~DevicePrefetcher();
  DevicePrefetcher(const DevicePrefetcher&) = delete;
  DevicePrefetcher& operator=(const DevicePrefetcher&) = delete;

  // Starts the loader's epoch `epoch` at `first_batch` (DataLoader::start_epoch) and queues
  // the copy of that batch; an unfinished epoch is abandoned.
  void start_epoch(int64_t epoch, int64_t first_batch = 0);
  // The next batch of the epoch with images and labels on device(); nullopt after the
  // last one. Rethrows the loader's error of this batch.
  std::optional<Batch> next();

  int64_t num_batches() const { return loader_.num_batches(); }
  Device device() const { return device_; }
  DataLoader& loader() const { return loader_; }

 private:
  struct InFlight;    // a batch whose copy is queued (device_prefetcher.cpp)
  struct CopyStream;  // the CUDA stream of the copies

  // Takes the loader's next batch and queues its copy; an error is kept for next().
  void fetch_ahead();

  DataLoader& loader_;
  const Device device_;
  std::unique_ptr<CopyStream> copy_stream_;  // first: outlives the batches copied on it
  std::unique_ptr<InFlight> ahead_;          // null: no batch ahead
  std::exception_ptr ahead_error_;           // the error of the batch after the last one
  bool epoch_started_ = false;
};

}  // namespace mtrain::data
