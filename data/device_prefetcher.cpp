// DevicePrefetcher (Note [Device prefetch]).
#include "data/device_prefetcher.h"

#include <fmt/format.h>

#include "core/error.h"
#include "tensor/cuda_memory.h"
#include "tensor/cuda_devices.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/stream.h"
#endif

// Note [Device prefetch]
// ~~~~~~~~~~~~~~~~~~~~~~
// The prefetcher keeps one batch ahead. start_epoch takes batch 0 from the loader and queues its
// host->device copy on the prefetcher's own copy stream, followed by an event. next() hands out
// that batch and, before returning, takes the following one from the loader and queues its copy
// the same way; so while step k runs on the consumer's current stream (Note [Current stream]),
// batch k+1 crosses PCIe. For the handed-out batch:
//   * the consumer's current stream is made to wait for its event (Event::block): kernels the
//     consumer queues afterwards read the batch only once it has arrived, and the host never
//     waits;
//   * its device tensors were allocated for the copy stream and are used on the consumer's
//     stream, which record_stream declares (tensor/cuda_memory.h): when the consumer drops them,
//     their blocks are not reused before its kernels are done.
// The host side of a batch is dropped once its copy is queued. From pinned memory
// (DataLoaderOptions::pin_memory) the copy is asynchronous, and Tensor::copy_ with non_blocking
// records the copy stream on the pinned block, so the pinned allocator gives that block to no
// later batch before the copy has read it. From pageable memory the copy is correct too, but CUDA
// returns only once it has staged the source, so it does not overlap.
//
// Everything else passes through: indices, epoch and batch_index, the order, and the last partial
// batch; an empty batch (0 rows) gets empty device tensors. An error of the loader (or of queueing
// a copy) belongs to the batch that was being fetched: next() still hands out the batch before it,
// and rethrows the error at the next call, and at every call after that until start_epoch (as the
// loader does).

namespace mtrain::data {

#ifdef MTRAIN_HAVE_CUDA

struct DevicePrefetcher::CopyStream {
  explicit CopyStream(int device) : owned(device) {}
  cuda::OwnedStream owned;
};

struct DevicePrefetcher::InFlight {
  // Queues the copies of `host`'s tensors on the copy stream, then the event.
  InFlight(Batch host, Device device, const CopyStream& copy)
      : batch(std::move(host)), copied(device.index) {
    const cuda::Stream stream = copy.owned.stream();
    // Current for the allocations too: the device blocks belong to the copy stream,
    // which writes them first (Note [Stream-ordered block reuse]).
    cuda::StreamGuard on_copy_stream(stream);
    batch.images = copy_to(batch.images, device);
    batch.labels = copy_to(batch.labels, device);
    copied.record(stream);
  }

  // The batch for the consumer, whose current stream waits for the copy.
  Batch hand_over(Device device) {
    const cuda::Stream consumer = cuda::current_stream(device.index);
    copied.block(consumer);
    record_stream(batch.images, device.index, consumer.handle());
    record_stream(batch.labels, device.index, consumer.handle());
    return std::move(batch);
  }

  Batch batch;
  cuda::Event copied;

 private:
  // With non_blocking, a pinned source gets the copy stream recorded on its block
  // (tensor/cuda/tensor_copy.cpp), so dropping it at once is safe.
  static Tensor copy_to(const Tensor& host, Device device) {
    Tensor on_device = Tensor::empty(host.shape(), host.dtype(), device);
    on_device.copy_(host, /*non_blocking=*/true);
    return on_device;
  }
};

#else

// Without CUDA the constructor refuses (cuda_info() reports no GPU) before it makes a
// CopyStream, and a CopyStream cannot be made here at all; so no InFlight, which needs
// one, can exist. These keep the class compiling.
struct DevicePrefetcher::CopyStream {
  explicit CopyStream(int device) {
    throw InvalidArgument(fmt::format(
        "DevicePrefetcher on cuda:{} needs a build with CUDA; this one has none", device));
  }
};

struct DevicePrefetcher::InFlight {
  InFlight(Batch, Device, const CopyStream&) {}
  Batch hand_over(Device) { return {}; }
};

#endif

DevicePrefetcher::DevicePrefetcher(DataLoader& loader, Device device)
    : loader_(loader), device_(device) {
  if (!device_.is_cuda()) {
    throw InvalidArgument(fmt::format(
        "DevicePrefetcher: expected a GPU device, found {} (on the CPU, use the loader's "
        "batches where they are)",
        device_.str()));
  }
  const CudaInfo& info = cuda_info();
  if (device_.index < 0 || device_.index >= info.device_count) {
    throw InvalidArgument(fmt::format("DevicePrefetcher: expected {} to be a usable GPU, found {}",
                                      device_.str(), cuda_summary()));
  }
  copy_stream_ = std::make_unique<CopyStream>(device_.index);
}

DevicePrefetcher::~DevicePrefetcher() = default;

void DevicePrefetcher::start_epoch(int64_t epoch, int64_t first_batch) {
  // The abandoned batch's device blocks belong to the copy stream, which orders their
  // reuse after its copy.
  ahead_.reset();
  ahead_error_ = nullptr;
  epoch_started_ = false;
  loader_.start_epoch(epoch, first_batch);  // the loader's own argument errors surface here
  epoch_started_ = true;
  fetch_ahead();
}

std::optional<Batch> DevicePrefetcher::next() {
  MTRAIN_CHECK(epoch_started_, "DevicePrefetcher::next() called before start_epoch()");
  if (!ahead_) {
    if (ahead_error_) std::rethrow_exception(ahead_error_);
    return std::nullopt;
  }
  const std::unique_ptr<InFlight> current = std::move(ahead_);
  fetch_ahead();
  return current->hand_over(device_);
}

void DevicePrefetcher::fetch_ahead() {
  try {
    std::optional<Batch> host = loader_.next();
    if (host) ahead_ = std::make_unique<InFlight>(std::move(*host), device_, *copy_stream_);
  } catch (...) {
    ahead_error_ = std::current_exception();
  }
}

}  // namespace mtrain::data
