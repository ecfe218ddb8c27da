// A gate on a CUDA stream (CUDA builds only): work queued on the stream after the gate
// waits until open() is called, so a test can hold a stream and see which work waited
// on it. The gate is a host function queued on the stream that sleeps until opened. It
// also opens by itself after `limit`, so a test that deadlocks on it (a host wait on the
// gated stream, say) fails with timed_out() instead of hanging.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "tensor/cuda/cuda_check.h"

namespace mtrain::testing {

class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream, std::chrono::seconds limit = std::chrono::seconds(30))
      : state_(std::make_shared<State>()) {
    state_->deadline = std::chrono::steady_clock::now() + limit;
    // The runtime's thread runs the function; it shares the state, so the gate object may
    // go away first.
    auto* held = new std::shared_ptr<State>(state_);
    const cudaError_t err = cudaLaunchHostFunc(stream, &StreamGate::wait, held);
    if (err != cudaSuccess) {
      delete held;
      MTRAIN_CUDA_CHECK(err);
    }
  }
  ~StreamGate() { open(); }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;

  void open() { state_->open.store(true); }
  // The gate opened by itself: something waited on the gated stream from the host.
  bool timed_out() const { return state_->timed_out.load(); }

 private:
  struct State {
    std::atomic<bool> open{false};
    std::atomic<bool> timed_out{false};
    std::chrono::steady_clock::time_point deadline;
  };

  static void CUDART_CB wait(void* arg) {
    std::unique_ptr<std::shared_ptr<State>> held(static_cast<std::shared_ptr<State>*>(arg));
    State& s = **held;
    while (!s.open.load()) {
      if (std::chrono::steady_clock::now() >= s.deadline) {
        s.timed_out.store(true);
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  std::shared_ptr<State> state_;
};

}  // namespace mtrain::testing
