// GpuGraph: work the calling thread queues on a GPU, captured once as a CUDA graph and
// replayed with one launch. Usable in builds with and without CUDA (without, the
// constructor throws InvalidArgument saying the build has none).
//
// Note [Captured steps]
// ~~~~~~~~~~~~~~~~~~~~~
// A training step queues some 375 kernels, each a host call of several microseconds, so
// a GPU that finishes a kernel faster than the host queues the next waits on the host.
// A CUDA graph queues them all with one launch. capture() makes a stream of the graph's
// own current while `work` runs (cudaStreamBeginCapture in relaxed mode, which lets
// the caching allocator call cudaMalloc for blocks the step has never had): kernels,
// copies and library calls are recorded, not run, with the addresses they were given.
// replay() then runs the whole of it on the caller's current stream, reading and
// writing exactly those addresses again, so three things must hold between replays:
// - Memory allocated during the capture stays the graph's: the allocator keeps the
//   capture stream's blocks private (caching_block_allocator.h) until the graph dies,
//   in use or not, so no other tensor is ever given an address the graph writes.
// - What the work reads from outside (inputs, parameters, gradients, statistics) lives
//   at fixed addresses that outlive the graph: the caller copies each new input into
//   the tensors it captured with, and nothing the graph reads is freed meanwhile.
// - The host decided nothing per call: a value the host computed during the capture
//   (a learning rate, a random seed, a batch size) is replayed as it was. Work that
//   reads the GPU's results on the host inside the capture cannot be captured at all
//   (the runtime refuses the synchronisation), and capture() says why.
// A GpuMark made during the capture is recorded by every replay (an external event
// node), so the host can wait for part of a replayed graph.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace mtrain {

class GpuGraph {
 public:
  // A graph for work on GPU `device`, nothing captured yet.
  explicit GpuGraph(int device);
  ~GpuGraph();  // waits for the graph's replays before its memory goes
  GpuGraph(const GpuGraph&) = delete;
  GpuGraph& operator=(const GpuGraph&) = delete;

  // Runs `work` with the graph's stream current on the device, recording what it queues
  // instead of running it, and makes it the graph's work. Returns "" when captured, else
  // why not (what `work` threw, or the runtime's refusal); then nothing is captured, and
  // nothing of `work` ran on the GPU. Once only: InternalError when already captured.
  std::string capture(const std::function<void()>& work);
  // Queues the captured work on the calling thread's current stream of the device
  // (InternalError before a capture).
  void replay();
  bool captured() const;
  // The captured graph's nodes (kernels, copies, event records), 0 before a capture.
  size_t nodes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace mtrain
