// What the CUDA runtime can see, asked without ever linking the driver library.
//
// On a machine without a driver, cudaGetDeviceCount fails with
// cudaErrorInsufficientDriver (not cudaErrorNoDevice) and leaves the count untouched;
// any error therefore means "no usable GPU" and `reason` says why. In a build
// without CUDA (-DMTRAIN_CUDA=OFF) the answer is always zero devices.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mtrain {

struct CudaInfo {
  bool compiled = false;        // built with the CUDA path
  int device_count = 0;         // usable devices (0 on any runtime error)
  std::string reason;           // why device_count is 0, when it is
  int runtime_version = 0;      // e.g. 13000
  int driver_version = 0;       // 0 without a driver
  int cudnn_version = 0;        // e.g. 91900
  std::vector<std::string> device_names;
};

// Queried once per process and cached.
const CudaInfo& cuda_info();

// One line for logs: "CUDA 13.0 compiled, no usable GPU (CUDA driver version is
// insufficient ...)" or "2 GPUs: NVIDIA H200 (cuda:0), ...".
std::string cuda_summary();

// Makes GPU `index` the calling thread's current device (cudaSetDevice), so work that
// names no device (library handles, the legacy default stream, NCCL's own set-up) lands
// on the GPU this process was bound to. Throws InvalidArgument for an index outside
// [0, cuda_info().device_count) and in a build without CUDA, Error when the runtime
// refuses.
void set_current_device(int index);

// Note [Helper threads and the process's GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The current device is per thread, and a thread that never chose one is on device 0:
// its first CUDA call that needs a context (an event query, cudaHostAlloc, restoring
// "the previous device" after a guard) opens a context on GPU 0, some 500 MiB of it,
// from every rank of a node, whatever GPU the rank was bound to. So a thread that calls
// CUDA makes the process's device (the last set_current_device, on any thread) its
// own first: adopt_process_device() does that once per thread, and does nothing before
// the process is bound or in a build without CUDA. Helper threads call it when they
// start; DeviceGuard and the allocator's event and pinned-memory paths call it too.
void adopt_process_device();

// The GPU's time between two points of the calling thread's current stream on `device`
// (two timing events), read without ever blocking the host. Throws InvalidArgument in a build
// without CUDA, Error when the runtime refuses.
class GpuStopwatch {
 public:
  explicit GpuStopwatch(int device);
  ~GpuStopwatch();
  GpuStopwatch(const GpuStopwatch&) = delete;
  GpuStopwatch& operator=(const GpuStopwatch&) = delete;

  void start();  // queues the start mark on the current stream
  void stop();   // queues the stop mark
  // Seconds from the start mark to the stop mark once the stream has passed both marks;
  // nullopt before that, and before the first start and stop.
  std::optional<double> seconds() const;

 private:
  struct Events;
  std::unique_ptr<Events> events_;
};

// A point of the calling thread's current stream on `device` (an event without timing),
// queued when made: wait() blocks the host until the stream has passed it, and not for
// the work queued after it. Throws InvalidArgument in a build without CUDA, Error when
// the runtime refuses.
class GpuMark {
 public:
  explicit GpuMark(int device);
  ~GpuMark();
  GpuMark(const GpuMark&) = delete;
  GpuMark& operator=(const GpuMark&) = delete;

  void wait() const;

 private:
  struct Event;
  std::unique_ptr<Event> event_;
};

}  // namespace mtrain
