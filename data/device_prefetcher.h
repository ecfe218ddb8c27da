// DevicePrefetcher: a DataLoader's batches on a GPU, each copied there on a stream of
// its own while the step before it runs.
//
//   DataLoader loader(dataset, sampler, {.batch_size = 64, .pin_memory = true});
//   DevicePrefetcher batches(loader, Device::cuda(0));
//   for (int64_t e = 0; e < epochs; ++e) {
//     batches.start_epoch(e);
//     while (auto batch = batches.next()) { ... }  // batch->images/labels on cuda:0
//   }
//
// Note [Device prefetch]
// ~~~~~~~~~~~~~~~~~~~~~~
// The prefetcher keeps one batch ahead. start_epoch takes batch 0 from the loader and
// queues its host->device copy on the prefetcher's own copy stream, followed by an
// event. next() hands out that batch and, before returning, takes the following one
// from the loader and queues its copy the same way; so while step k runs on the
// consumer's current stream (Note [Current stream]), batch k+1 crosses PCIe. For the
// handed-out batch:
//   * the consumer's current stream is made to wait for its event (Event::block): kernels
//     the consumer queues afterwards read the batch only once it has arrived, and the
//     host never waits;
//   * its device tensors were allocated for the copy stream and are used on the
//     consumer's stream, which record_stream declares (tensor/cuda_memory.h): when the
//     consumer drops them, their blocks are not reused before its kernels are done.
// The host side of a batch is dropped once its copy is queued. From pinned memory
// (DataLoaderOptions::pin_memory) the copy is asynchronous, and Tensor::copy_ with
// non_blocking records the copy stream on the pinned block, so the pinned allocator
// gives that block to no later batch before the copy has read it. From pageable memory
// the copy is correct too, but CUDA returns only once it has staged the source, so it
// does not overlap.
//
// Everything else passes through: indices, epoch and batch_index, the order, and the
// last partial batch; an empty batch (0 rows) gets empty device tensors. An error of the
// loader (or of queueing a copy) belongs to the batch that was being fetched: next()
// still hands out the batch before it, and rethrows the error at the next call, and at
// every call after that until start_epoch (as the loader does). next() and start_epoch
// are meant to be called from one consumer thread, the one whose current stream runs
// the steps.
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

  // Starts the loader's epoch `epoch` and queues the copy of its first batch; an
  // unfinished epoch is abandoned.
  void start_epoch(int64_t epoch);
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
