// GradientSynchronizer: what the training loop does with gradients between backward and the
// optimizer step. Per micro-batch the loop calls
//     [zero_grad] -> forward -> loss -> before_backward(mb) -> model.backward() -> after_backward()
//       -> [optimizer.step()]
// with skip_backward() in place of model.backward() for an empty micro-batch; zero_grad and the
// step once per group of --grad-accum micro-batches, `sync` set only on a group's last
// micro-batch. The step's control exchange (stop votes, compute times, sample counts) is not
// the synchronizer's: StepExchange (step_exchange.h) sends it around the same backward. attach()
// installs the model's grad-ready hook (Note [Grad-ready hook] in models/module.cpp), which
// must report every parameter exactly once per backward. All calls come from the training
// thread. LocalGradients is the world of one (Note [Gradient synchronizer]
// in gradient_sync.cpp); the DDP Reducer is in reducer.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/module.h"

namespace mtrain {

struct MicroBatchInfo {
  int64_t samples = 0;  // rows of this rank's micro-batch
  bool sync = true;     // false: accumulate locally, no communication (no_sync)
  // With --global-batch-size: the samples of every rank's micro-batch of this step together,
  // as this rank's sampler plans them (Note [Reducer gradient weighting] in reducer.cpp).
  std::optional<int64_t> world_samples = std::nullopt;
};

// Gradients as views into a flat tensor (the Reducer's buckets, LocalGradients' arena):
// seat_gradient makes p's gradient the view of `flat` at `offset`, its values copied in;
// check_seated throws InternalError unless it still is one (a gradient re-seated since
// would keep its values through a fill of `flat`).
void seat_gradient(models::Parameter& p, const Tensor& flat, int64_t offset);
// Where the next gradient goes in a flat tensor after one of `numel` floats at `offset`:
// every gradient starts on a 64-byte boundary, as a tensor of its own would (the
// allocators' alignment), so kernels that write it see the addresses they would see
// outside (vector loads and stores need 16 bytes; the CPU kernels' paths depend on it).
int64_t next_gradient_offset(int64_t offset, int64_t numel);
void check_seated(const models::Parameter& p, const std::string& name, const Tensor& flat);

class GradientSynchronizer {
 public:
  virtual ~GradientSynchronizer() = default;
  // Installs the grad-ready hook in `model`; call once the model's structure is final.
  virtual void attach(models::Module& model) = 0;
  // Zeroes every gradient of the attached model (the loop's zero_grad before a step's first
  // micro-batch). attach() makes the gradients views into flat tensors (the Reducer's
  // buckets, LocalGradients' one arena), so this is one fill per flat tensor where
  // Module::zero_grad fills every tensor: 3 or 1 instead of 76 for resnet18, each a kernel
  // launch on a GPU.
  virtual void zero_gradients() = 0;
  // Called right before each backward.
  virtual void before_backward(const MicroBatchInfo& micro_batch) = 0;
  // After before_backward: the factor the loop multiplies the loss gradient by before
  // this backward (Note [Reducer gradient weighting] in reducer.cpp); 1 unless ranks
  // hold different numbers of samples.
  virtual float loss_gradient_scale() const { return 1.0f; }
  // In place of model.backward() when the micro-batch holds no samples: every gradient is
  // final as it stands, and goes out where the backward would have sent it, so that the
  // ranks' collectives come in one order. Throws InternalError for a non-empty micro-batch.
  virtual void skip_backward() = 0;
  // Called right after each backward; on return every gradient is final.
  virtual void after_backward() = 0;
  // Whether a CUDA graph may hold a backward with this synchronizer's hook in it (Note
  // [Captured steps] in tensor/cuda_graph.h): true where the hook queues no device work
  // that the host decides per step and waits for nothing, as in a world of one.
  virtual bool capturable() const { return false; }
  // Between before_backward and after_backward, in place of model.backward(), when a
  // replayed graph has computed the gradients of a backward captured with this
  // synchronizer's hook: every parameter counts as reported once. InternalError unless
  // capturable().
  virtual void backward_replayed();
  // One line for logs.
  virtual std::string describe() const = 0;
  // This rank's host wait for the gradients after its last synchronized backward, in ns
  // (Note [Every rank's wait] in step_exchange.cpp); -1 before the first, and where the wait
  // is not measured (a GPU, a world of one).
  virtual int64_t last_wait_ns() const { return -1; }
};

// The world-of-one synchronizer: nothing to reduce; attach() moves every float32 gradient on one
// device into one flat arena; after_backward() throws InternalError when a parameter
// reported its gradient other than once.
class LocalGradients final : public GradientSynchronizer {
 public:
  void attach(models::Module& model) override;
  void zero_gradients() override;
  void before_backward(const MicroBatchInfo& micro_batch) override;
  void skip_backward() override;
  void after_backward() override;
  bool capturable() const override { return true; }
  void backward_replayed() override;
  std::string describe() const override;

 private:
  void on_gradient_ready(const models::Parameter& param);

  models::Module* model_ = nullptr;
  Tensor arena_;  // every gradient, each parameter's a view (Note [Gradient synchronizer])
  int64_t samples_ = 0;  // the current micro-batch's MicroBatchInfo::samples

  std::vector<std::string> names_;  // by Parameter::index
  std::vector<int> ready_count_;    // hook calls per parameter in the current backward
};

}  // namespace mtrain
