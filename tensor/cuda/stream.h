// CUDA streams, events and the per-thread current stream (CUDA builds only).
//
// Note [Current stream]
// ~~~~~~~~~~~~~~~~~~~~~
// Every thread has a current stream per device, the legacy default stream (handle
// nullptr) until set_current_stream or a StreamGuard says otherwise. Tensor operations
// on a device (copies, fills, kernels) are queued on it, and the caching allocator
// hands out memory for it (Note [Stream-ordered block reuse]). Work on other streams
// joins the current one through events: a collective makes its own stream wait for the
// caller's current stream before it starts, and Work::wait_on_current_stream makes the
// caller's current stream wait for the collective.
#pragma once

#include <cuda_runtime.h>

namespace mtrain::cuda {

// A stream handle on a device; does not own the stream.
class Stream {
 public:
  Stream() = default;  // the default stream of device 0
  Stream(int device, cudaStream_t handle) : device_(device), handle_(handle) {}
  int device() const { return device_; }
  cudaStream_t handle() const { return handle_; }
  void synchronize() const;  // blocks the host until the stream's work is done
  // Not defaulted: .cu files compile as C++17 (see Device::operator== in tensor.h).
  bool operator==(const Stream& o) const { return device_ == o.device_ && handle_ == o.handle_; }
  bool operator!=(const Stream& o) const { return !(*this == o); }

 private:
  int device_ = 0;
  cudaStream_t handle_ = nullptr;
};

// A stream created with cudaStreamNonBlocking (no implicit ordering with the legacy
// default stream: order is always explicit, through events), held for this object's
// lifetime. The destructor waits for the stream's work and hands the stream back to a
// per-device pool, which gives it to the next OwnedStream: streams are never
// destroyed (Note [Streams outlive their blocks] in stream.cpp).
class OwnedStream {
 public:
  explicit OwnedStream(int device);
  ~OwnedStream();
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  Stream stream() const { return stream_; }

 private:
  Stream stream_;
};

// Owns an event created on `device` without timing (cheapest to record and query).
class Event {
 public:
  explicit Event(int device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(Stream stream);       // stream must be on the event's device
  bool completed() const;           // the last record's work is done (true if never recorded)
  void synchronize() const;         // blocks the host until then
  void block(Stream stream) const;  // work queued on `stream` from now on waits for it
  cudaEvent_t handle() const { return event_; }
  int device() const { return device_; }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

// Makes `device` current for the calling thread and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Whether work queued on `stream` now is captured into a CUDA graph rather than run (Note
// [Captured steps] in tensor/cuda_graph.h); the legacy default stream never is.
bool is_capturing(Stream stream);

// The calling thread's current stream on `device` (Note [Current stream]).
Stream current_stream(int device);
void set_current_stream(Stream stream);

// Makes `stream` current on its device for the calling thread, restoring the previous
// current stream on destruction.
class StreamGuard {
 public:
  explicit StreamGuard(Stream stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
};

}  // namespace mtrain::cuda
