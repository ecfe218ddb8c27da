#include "trainer/loop/step_graph.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "core/trace.h"
#include "tensor/cuda_memory.h"

namespace mtrain {

// Note [A captured training step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On a GPU, --cuda-graphs queues a micro-batch's ~375 kernels of forward, loss and
// backward with one graph launch instead of one host call each (Note [Captured steps] in
// tensor/cuda_graph.h says what a replay repeats). The graph holds exactly that part of
// the step; what the host decides per step stays outside it and is queued as before:
// zeroing the gradients (one fill), the learning rate and the optimizer step (one kernel,
// so no learning rate has to live in device memory), the loss read, the stop vote and
// the exchange. Inside, every value the host supplies is the same every step:
// - the inputs: each micro-batch's images and labels are copied (on the GPU) into the
//   two tensors the capture read, which the StepGraph keeps;
// - the loss: its statistics go to the same pinned buffer every replay, behind a mark
//   the replay records (an external event node), so the host still reads the loss while
//   the GPU runs the backward (Note [The loss is read after backward is queued] in
//   train_loop.cpp), from the pending loss of the capture;
// - the gradients: views into the synchronizer's flat tensors, which outlive the graph;
//   its grad-ready hook fires while capturing, and backward_replayed() stands for it in
//   a replay, which only a synchronizer whose hook queues nothing on the GPU allows (a
//   world of one, Note [A group of one reduces nothing] in trainer/ddp/reducer.cpp);
// - the layers: none may decide on the host per call (Module::replayable: Dropout's
//   draws, SyncBatchNorm's host waits);
// - the size: only micro-batches of the first shape seen replay; an epoch's short last
//   batch runs as usual, and so does evaluation.
// So a run with graphs computes what the same run without them computes, bit for bit
// where the kernels are deterministic. What a step cannot hold (--grad-accum's scaling
// per micro-batch, --amp fp16's loss scale, --balance's timing) turns graphs off at the
// start, with one log line naming why; a capture the runtime refuses (work that reads
// the GPU on the host) turns them off at that step, with one line, and the step runs
// as usual.
std::string step_graph_unsupported(const StepGraphSettings& settings, models::Module& model,
                                   const GradientSynchronizer& sync) {
  if (!settings.device.is_cuda()) return "training on the CPU, which has no graphs to capture";
  if (settings.grad_accum != 1) return fmt::format("--grad-accum {} scales each micro-batch's loss", settings.grad_accum);
  if (settings.loss_scaling) return "the dynamic loss scale (--amp fp16) changes from step to step";
  if (settings.time_compute) return "--balance times each step's compute";
  if (!sync.capturable()) return fmt::format("the gradients' synchronizer queues its own work: {}", sync.describe());
  for (const auto& [name, module] : model.named_modules()) {
    if (!module->replayable()) {
      return fmt::format("layer {} ({}) decides on the host at every call", name.empty() ? "(the model)" : name,
                         module->type_name());
    }
  }
  return {};
}

StepGraph::StepGraph(Device device) : device_(device) {
  MTRAIN_CHECK(device.is_cuda(), "StepGraph on {}", device.str());
}

bool StepGraph::takes(const data::Batch& batch) {
  if (failed_ || batch.size() == 0) return false;
  if (!shape_) shape_ = batch.images.shape();
  if (batch.images.shape() != *shape_) return false;
  if (graph_) return true;
  if (warmed_up_ < kWarmupMicroBatches) {
    ++warmed_up_;
    return false;
  }
  return true;
}

const models::PendingLoss* StepGraph::run(const data::Batch& batch, const CapturedForward& forward,
                                          const std::function<void()>& backward, const std::function<void()>& replayed) {
  MTRAIN_CHECK(!failed_, "StepGraph::run after a failed capture");
  if (!graph_) {
    if (const std::string failure = capture(batch, forward, backward); !failure.empty()) {
      spdlog::warn("--cuda-graphs: the step could not be captured, so it runs without a graph: {}", failure);
      failed_ = true;
      pending_.reset();  // after the capture ended: its pinned buffer's free records an event
      graph_.reset();
      images_ = labels_ = Tensor();
      return nullptr;
    }
    spdlog::info("--cuda-graphs: forward, loss and backward captured as one graph of {} nodes for micro-batches "
                 "of {} images; each replays it",
                 graph_->nodes(), batch.size());
  } else {
    replayed();
  }
  const trace::Span span("graph replay", "compute", "images", batch.size());
  images_.copy_(batch.images);
  labels_.copy_(batch.labels);
  graph_->replay();
  return &*pending_;
}

// The capture itself: "" once captured, else why not.
std::string StepGraph::capture(const data::Batch& batch, const CapturedForward& forward,
                               const std::function<void()>& backward) {
  const trace::Span span("graph capture", "compute");
  try {
    // The warm-up's activations stay cached for the current stream, which from now on
    // needs them only for a short batch or an evaluation; given back before the capture
    // allocates its own (after the steps queued so far have finished with them), the
    // capture never holds twice a step's memory, nor runs out of it mid-capture.
    cuda_release_cached_memory(device_.index);
    images_ = Tensor::empty(batch.images.shape(), batch.images.dtype(), device_);
    labels_ = Tensor::empty(batch.labels.shape(), batch.labels.dtype(), device_);
    graph_.emplace(device_.index);
    // The pending loss is kept before the backward is captured: were it destroyed inside
    // the capture (a backward that throws), its buffer's free would record an event there.
    return graph_->capture([&] {
      pending_.emplace(forward(images_, labels_));
      backward();
    });
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace mtrain
