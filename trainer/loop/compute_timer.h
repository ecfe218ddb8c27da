// ComputeTimer: this rank's forward and backward time per step, for --balance (Note [Measuring
// each rank's speed] in trainer/ddp/share_policy.cpp). The loop calls start() right before a
// step's forward, pause() after it, resume() right before its backward and stop(images) right
// after it (an empty batch too: start, stop), so what the loop does between forward and backward
// is not counted; during the next step, previous() gives that step's time. On the CPU it is the host's time less what
// SyncBatchNorm spent waiting for its peers; on a GPU the device's time between the two marks on
// the current stream, read without blocking (Note [Timing on a GPU] in compute_timer.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "models/module.h"
#include "tensor/cuda_devices.h"
#include "tensor/tensor.h"
#include "trainer/ddp/step_exchange.h"

namespace mtrain {

class ComputeTimer {
 public:
  // `model` (for its SyncBatchNorm waits) must outlive the timer. Throws as GpuStopwatch
  // does for a GPU that cannot be used.
  ComputeTimer(Device device, models::Module& model);

  void start();
  void pause();
  void resume();
  void stop(int64_t images);
  // The step before the running one (the last stopped one before start()): its images, and
  // its time, -1 when not known (none yet, or a GPU that has not passed its stop mark).
  RankCompute previous();

 private:
  using Clock = std::chrono::steady_clock;

  Device device_;
  models::Module& model_;
  // CPU
  Clock::time_point started_;
  double sync_bn_wait_at_start_ = 0.0;
  double cpu_seconds_ = 0.0;  // of the intervals ended so far
  // The last stopped step, and the one before it (what previous() reports once start() began a new step).
  RankCompute stopped_;
  RankCompute before_;
  // GPU: forward and backward stopwatches per step parity, so the running step never
  // overwrites the marks of the step whose time is still to be read.
  std::unique_ptr<GpuStopwatch> forward_[2];
  std::unique_ptr<GpuStopwatch> backward_[2];
  int current_ = 0;
};

}  // namespace mtrain
