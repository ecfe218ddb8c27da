// StepGraph: --cuda-graphs in the training loop. A micro-batch's forward, loss and
// backward are captured once as a CUDA graph (GpuGraph, tensor/cuda_graph.h) after a few
// micro-batches that ran as usual, and replayed for every later micro-batch of the same
// shape, its images and labels first copied into the tensors the graph captured with.
// The optimizer step, the gradient zeroing, the exchange and everything the host decides
// per step stay outside (Note [A captured training step] in step_graph.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "data/dataloader.h"
#include "models/loss.h"
#include "models/module.h"
#include "tensor/cuda_graph.h"
#include "trainer/ddp/gradient_sync.h"

namespace mtrain {

// What decides whether a run's steps can be captured.
struct StepGraphSettings {
  Device device = Device::cpu();
  int64_t grad_accum = 1;
  bool loss_scaling = false;  // --amp fp16's dynamic loss scale (GradScaler)
  bool time_compute = false;  // --balance's per-step timing
};

// Why a run with these settings, this model and this synchronizer cannot capture its
// steps, naming the flag or layer; "" when it can.
std::string step_graph_unsupported(const StepGraphSettings& settings, models::Module& model,
                                   const GradientSynchronizer& sync);

// The forward and loss of one micro-batch on the given images and labels, returning its
// pending loss; the graph runs it, and the backward after it, once, while capturing.
using CapturedForward = std::function<models::PendingLoss(const Tensor& images, const Tensor& labels)>;

class StepGraph {
 public:
  // Micro-batches of the first shape seen that run as usual before the capture: the
  // first plans every convolution (and times them under --cudnn-benchmark), so the
  // capture sees the steady state.
  static constexpr int64_t kWarmupMicroBatches = 2;

  explicit StepGraph(Device device);

  // Whether `batch` goes through the graph (its capture or a replay): a micro-batch of
  // the first shape seen, after the warm-up, while no capture has failed. Counts the
  // warm-up.
  bool takes(const data::Batch& batch);
  // The micro-batch's forward, loss and backward from the graph, queued on the current
  // stream; between the synchronizer's before_backward and after_backward. The first
  // call captures `forward` and `backward` (whose grad-ready hooks fire then); later
  // calls replay them and call `replayed` in place of the hooks. Returns the
  // micro-batch's pending loss, or nullptr when the capture failed: the log says why,
  // once, nothing ran, and the graph takes nothing more.
  const models::PendingLoss* run(const data::Batch& batch, const CapturedForward& forward,
                                 const std::function<void()>& backward, const std::function<void()>& replayed);

 private:
  std::string capture(const data::Batch& batch, const CapturedForward& forward,
                      const std::function<void()>& backward);

  Device device_;
  std::optional<Shape> shape_;  // the images' shape of the first micro-batch seen
  int64_t warmed_up_ = 0;
  bool failed_ = false;
  Tensor images_, labels_;                    // the captured inputs
  std::optional<models::PendingLoss> pending_;  // the captured loss, refreshed by each replay
  std::optional<GpuGraph> graph_;
};

}  // namespace mtrain
