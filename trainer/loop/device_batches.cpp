#include "trainer/loop/device_batches.h"

namespace mtrain {

// Note [Batches to the device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The training loop and the evaluation read every batch through DeviceBatches. On the CPU it hands
// the loader's tensors through untouched (no copy, so a CPU run computes exactly what it would
// without it). On a GPU it reads through a DevicePrefetcher (Note [Device prefetch] in
// data/device_prefetcher.cpp): batch k+1 is copied to the GPU on a stream of its own while step k
// runs, and the step's kernels are ordered after the copy on the GPU, not by blocking the host. The
// copy overlaps only from pinned host memory, so a loader that feeds a GPU is built with
// pin_memory (start_up.cpp).
DeviceBatches::DeviceBatches(data::DataLoader& loader, Device device) : loader_(loader), device_(device) {
  if (device_.is_cuda()) prefetcher_ = std::make_unique<data::DevicePrefetcher>(loader_, device_);
}

void DeviceBatches::start_epoch(int64_t epoch, int64_t first_batch) {
  if (prefetcher_) {
    prefetcher_->start_epoch(epoch, first_batch);
  } else {
    loader_.start_epoch(epoch, first_batch);
  }
}

std::optional<data::Batch> DeviceBatches::next() { return prefetcher_ ? prefetcher_->next() : loader_.next(); }

}  // namespace mtrain
