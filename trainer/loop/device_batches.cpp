#include "trainer/loop/device_batches.h"

namespace mtrain {

DeviceBatches::DeviceBatches(data::DataLoader& loader, Device device) : loader_(loader), device_(device) {
  if (device_.is_cuda()) prefetcher_ = std::make_unique<data::DevicePrefetcher>(loader_, device_);
}

void DeviceBatches::start_epoch(int64_t epoch) {
  if (prefetcher_) {
    prefetcher_->start_epoch(epoch);
  } else {
    loader_.start_epoch(epoch);
  }
}

std::optional<data::Batch> DeviceBatches::next() { return prefetcher_ ? prefetcher_->next() : loader_.next(); }

}  // namespace mtrain
