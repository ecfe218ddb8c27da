#include "trainer/loop/compute_timer.h"

#include <cmath>

#include "models/sync_batchnorm.h"

namespace mtrain {

ComputeTimer::ComputeTimer(Device device, models::Module& model) : device_(device), model_(model) {
  if (device_.is_cuda()) {
    for (int k = 0; k < 2; ++k) {
      forward_[k] = std::make_unique<GpuStopwatch>(device_.index);
      backward_[k] = std::make_unique<GpuStopwatch>(device_.index);
    }
  }
}

// Note [Timing on a GPU]
// ~~~~~~~~~~~~~~~~~~~~~~
// On a GPU the host only queues forward and backward, so the host's clock says nothing of their
// cost. Two timing events on the current stream do: the start mark is passed when the stream
// actually begins the forward (after the previous step's optimizer, which waited for the
// all-reduces), the stop mark when the backward's kernels are done. Reading them never blocks: a
// step's marks are read during the next step, once its loss is on the host (Note [The loss is
// read after backward is queued] in train_loop.cpp), which the stream has passed them by, and the
// two stopwatches alternate so that the next step's marks do not overwrite them.
// What the marks cannot separate is SyncBatchNorm's collectives queued on the stream between them.
void ComputeTimer::start() {
  before_ = stopped_;
  stopped_ = RankCompute{};
  if (device_.is_cuda()) {
    current_ ^= 1;
    forward_[current_]->start();
    return;
  }
  cpu_seconds_ = 0.0;
  sync_bn_wait_at_start_ = models::sync_batchnorm_wait_seconds(model_);
  started_ = Clock::now();
}

void ComputeTimer::pause() {
  if (device_.is_cuda()) {
    forward_[current_]->stop();
    return;
  }
  cpu_seconds_ += std::chrono::duration<double>(Clock::now() - started_).count();
}

void ComputeTimer::resume() {
  if (device_.is_cuda()) {
    backward_[current_]->start();
    return;
  }
  started_ = Clock::now();
}

void ComputeTimer::stop(int64_t images) {
  if (device_.is_cuda()) {
    backward_[current_]->stop();
    stopped_ = {-1, images};  // read by previous() during the next step
    return;
  }
  cpu_seconds_ += std::chrono::duration<double>(Clock::now() - started_).count();
  const double waited = models::sync_batchnorm_wait_seconds(model_) - sync_bn_wait_at_start_;
  stopped_ = {static_cast<int64_t>(std::llround(std::max(cpu_seconds_ - waited, 0.0) * 1e9)), images};
}

RankCompute ComputeTimer::previous() {
  if (device_.is_cuda() && before_.images > 0 && before_.nanoseconds < 0) {
    const int k = current_ ^ 1;
    const std::optional<double> forward = forward_[k]->seconds();
    const std::optional<double> backward = backward_[k]->seconds();
    if (forward && backward) before_.nanoseconds = static_cast<int64_t>(std::llround((*forward + *backward) * 1e9));
  }
  return before_;
}

}  // namespace mtrain
