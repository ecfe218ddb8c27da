#include "tensor/cuda/stream.h"

#include <vector>

#include "tensor/cuda/cuda_check.h"

namespace mtrain::cuda {

void Stream::synchronize() const {
  DeviceGuard guard(device_);
  MTRAIN_CUDA_CHECK(cudaStreamSynchronize(handle_));
}

OwnedStream::OwnedStream(int device) {
  DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  MTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = Stream(device, s);
}

OwnedStream::~OwnedStream() {
  // Finish the stream's work first: the caching allocator keys its pools by stream
  // handle, and a later stream may be given the same handle; its blocks must not be
  // reused while this stream's kernels might still touch them. Errors cannot be
  // reported from a destructor.
  cudaStreamSynchronize(stream_.handle());
  cudaStreamDestroy(stream_.handle());
}

Event::Event(int device) : device_(device) {
  DeviceGuard guard(device);
  MTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

Event::~Event() { cudaEventDestroy(event_); }

void Event::record(Stream stream) {
  MTRAIN_CHECK(stream.device() == device_, "event of cuda:{} recorded on a stream of cuda:{}",
               device_, stream.device());
  DeviceGuard guard(device_);
  MTRAIN_CUDA_CHECK(cudaEventRecord(event_, stream.handle()));
}

bool Event::completed() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) return false;
  MTRAIN_CUDA_CHECK(err);
  return false;
}

void Event::synchronize() const { MTRAIN_CUDA_CHECK(cudaEventSynchronize(event_)); }

void Event::block(Stream stream) const {
  DeviceGuard guard(stream.device());
  MTRAIN_CUDA_CHECK(cudaStreamWaitEvent(stream.handle(), event_, 0));
}

DeviceGuard::DeviceGuard(int device) {
  MTRAIN_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) {
    MTRAIN_CUDA_CHECK(cudaSetDevice(device));
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);
}

namespace {
// Index = device; an absent entry is the legacy default stream.
thread_local std::vector<cudaStream_t> t_current_streams;
}  // namespace

Stream current_stream(int device) {
  MTRAIN_CHECK(device >= 0, "current_stream of device {}", device);
  const auto d = static_cast<size_t>(device);
  return Stream(device, d < t_current_streams.size() ? t_current_streams[d] : nullptr);
}

void set_current_stream(Stream stream) {
  MTRAIN_CHECK(stream.device() >= 0, "set_current_stream on device {}", stream.device());
  const auto d = static_cast<size_t>(stream.device());
  if (d >= t_current_streams.size()) t_current_streams.resize(d + 1, nullptr);
  t_current_streams[d] = stream.handle();
}

StreamGuard::StreamGuard(Stream stream) : previous_(current_stream(stream.device())) {
  set_current_stream(stream);
}

StreamGuard::~StreamGuard() { set_current_stream(previous_); }

}  // namespace mtrain::cuda
