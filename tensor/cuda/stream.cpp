#include "tensor/cuda/stream.h"

#include <mutex>
#include <vector>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda_devices.h"

namespace mtrain::cuda {

void Stream::synchronize() const {
  DeviceGuard guard(device_);
  MTRAIN_CUDA_CHECK(cudaStreamSynchronize(handle_));
}

// Note [Streams outlive their blocks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The caching allocator files a device block under the stream it was allocated for,
// and freeing the block records an event on that stream (Note [Stream-ordered block
// reuse] in tensor/caching_block_allocator.h); so do the blocks other streams used
// (record_stream). A block often dies after the object that made its stream: the last
// evaluation batch, copied on a data prefetcher's stream, stays saved in the model's
// first layer until the next training step frees it, long after evaluate() destroyed
// that prefetcher. Recording an event on a destroyed stream is undefined, and a new
// stream could be given the old handle and inherit its pool. So a stream, once
// created, lives as long as the process: an OwnedStream that ends returns its stream
// to a pool of idle streams on its device, and the next OwnedStream on that device
// takes it from there (PyTorch keeps its streams for the process's lifetime for the
// same reason). Work queued by the next holder is ordered after the earlier holder's,
// since it is the same stream.
namespace {

std::mutex& pool_mutex() {
  static std::mutex mu;
  return mu;
}

// Idle streams per device; never destroyed, like the streams themselves.
std::vector<std::vector<cudaStream_t>>& idle_streams() {
  static auto* pools = new std::vector<std::vector<cudaStream_t>>();
  return *pools;
}

}  // namespace

OwnedStream::OwnedStream(int device) {
  MTRAIN_CHECK(device >= 0, "OwnedStream on device {}", device);
  {
    std::lock_guard<std::mutex> lock(pool_mutex());
    auto& pools = idle_streams();
    const auto d = static_cast<size_t>(device);
    if (d < pools.size() && !pools[d].empty()) {
      stream_ = Stream(device, pools[d].back());
      pools[d].pop_back();
      return;
    }
  }
  DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  MTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = Stream(device, s);
}

OwnedStream::~OwnedStream() {
  // The holder's work is finished before the stream changes hands, so that nothing of
  // it overlaps the next holder's. Errors cannot be reported from a destructor.
  cudaStreamSynchronize(stream_.handle());
  std::lock_guard<std::mutex> lock(pool_mutex());
  auto& pools = idle_streams();
  const auto d = static_cast<size_t>(stream_.device());
  if (d >= pools.size()) pools.resize(d + 1);
  pools[d].push_back(stream_.handle());
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
  adopt_process_device();
  return MTRAIN_CUDA_QUERY(cudaEventQuery(event_));
}

void Event::synchronize() const {
  adopt_process_device();
  MTRAIN_CUDA_CHECK(cudaEventSynchronize(event_));
}

void Event::block(Stream stream) const {
  DeviceGuard guard(stream.device());
  MTRAIN_CUDA_CHECK(cudaStreamWaitEvent(stream.handle(), event_, 0));
}

DeviceGuard::DeviceGuard(int device) {
  adopt_process_device();  // so that "previous" is never an unchosen device 0
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

bool is_capturing(Stream stream) {
  if (stream.handle() == nullptr) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MTRAIN_CUDA_CHECK(cudaStreamIsCapturing(stream.handle(), &status));
  return status != cudaStreamCaptureStatusNone;
}

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

namespace mtrain {

struct GpuStopwatch::Events {
  int device = 0;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  bool started = false;
  bool stopped = false;
};

GpuStopwatch::GpuStopwatch(int device) : events_(std::make_unique<Events>()) {
  events_->device = device;
  cuda::DeviceGuard guard(device);
  MTRAIN_CUDA_CHECK(cudaEventCreate(&events_->start));
  const cudaError_t err = cudaEventCreate(&events_->stop);
  if (err != cudaSuccess) cudaEventDestroy(events_->start);
  MTRAIN_CUDA_CHECK(err);
}

GpuStopwatch::~GpuStopwatch() {
  cudaEventDestroy(events_->start);
  cudaEventDestroy(events_->stop);
}

void GpuStopwatch::start() {
  cuda::DeviceGuard guard(events_->device);
  MTRAIN_CUDA_CHECK(cudaEventRecord(events_->start, cuda::current_stream(events_->device).handle()));
  events_->started = true;
  events_->stopped = false;
}

void GpuStopwatch::stop() {
  cuda::DeviceGuard guard(events_->device);
  MTRAIN_CUDA_CHECK(cudaEventRecord(events_->stop, cuda::current_stream(events_->device).handle()));
  events_->stopped = true;
}

std::optional<double> GpuStopwatch::seconds() const {
  if (!events_->started || !events_->stopped) return std::nullopt;
  adopt_process_device();
  if (!MTRAIN_CUDA_QUERY(cudaEventQuery(events_->stop))) return std::nullopt;
  // The start mark may still be pending when the marks were queued on different streams.
  if (!MTRAIN_CUDA_QUERY(cudaEventQuery(events_->start))) return std::nullopt;
  float ms = 0.0f;
  MTRAIN_CUDA_CHECK(cudaEventElapsedTime(&ms, events_->start, events_->stop));
  return static_cast<double>(ms) * 1e-3;
}

struct GpuMark::Event {
  explicit Event(int device) : event(device) {}
  cuda::Event event;
};

GpuMark::GpuMark(int device) : event_(std::make_unique<Event>(device)) {
  const cuda::Stream stream = cuda::current_stream(device);
  // Note [Captured steps]: a mark made while the stream is captured is a node of the
  // graph, recorded by each replay.
  if (!cuda::is_capturing(stream)) {
    event_->event.record(stream);
    return;
  }
  cuda::DeviceGuard guard(device);
  MTRAIN_CUDA_CHECK(cudaEventRecordWithFlags(event_->event.handle(), stream.handle(), cudaEventRecordExternal));
}

GpuMark::~GpuMark() = default;

void GpuMark::wait() const { event_->event.synchronize(); }

}  // namespace mtrain
