// What the training loop does with gradients between backward and the optimizer step.
//
// Note [Gradient synchronizer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The loop runs, per micro-batch:
//     [zero_grad] -> forward -> loss -> sync.before_backward(step) -> model.backward()
//       -> sync.after_backward() -> [optimizer.step()]
// and the model reports each parameter's gradient the moment it is final through the
// grad-ready hook (models/module.h, Note [Grad-ready hook]) that attach() installs.
// zero_grad and the optimizer step happen once per group of --grad-accum micro-batches;
// only the last micro-batch of a group has `step.sync` set (no_sync for the others).
// With one process there is nothing to exchange, so LocalGradients only checks the
// hook contract (every parameter exactly once per backward), which keeps the path the
// DDP Reducer takes (trainer/ddp/reducer.h) exercised by every single-process run.
//
// Note [Agreeing to stop]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A stop signal (Note [Stopping on a signal] in stop_signals.h) reaches the ranks at
// slightly different moments, or only one of them, yet every rank must stop after the
// same optimizer step, or the ones that carry on wait forever in the next all-reduce.
// The last micro-batch of every step carries this rank's stop vote (Note [Stop votes]);
// the Reducer all-gathers the votes (16 bytes per rank: the vote and the rank's
// previous wait, Note [Every rank's wait] in reducer.h) together with the gradient
// buckets, asynchronously, and waits for them with the buckets in after_backward, so
// the agreement costs no extra round trip: after the step every rank reads the same
// agreed_stop_vote(), the largest vote, and either carries on or stops. A vote cast at
// step N is honoured after step N on every rank. With one process the agreed vote is
// the local one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/module.h"

namespace mtrain {

struct MicroBatchInfo {
  int64_t samples = 0;  // rows of this rank's micro-batch
  bool sync = true;     // false: accumulate locally, no communication (no_sync)
  // This rank's stop vote, exchanged with the gradients when `sync` is set (Note
  // [Agreeing to stop]); 0 means carry on.
  int64_t stop_vote = 0;
};

class GradientSynchronizer {
 public:
  virtual ~GradientSynchronizer() = default;
  // Installs the grad-ready hook in `model`; call once the model's structure is final.
  virtual void attach(models::Module& model) = 0;
  // Called right before each backward.
  virtual void before_backward(const MicroBatchInfo& micro_batch) = 0;
  // After before_backward: the factor the loop multiplies the loss gradient by before
  // this backward (Note [Reducer gradient weighting] in reducer.h); 1 unless ranks
  // hold different numbers of samples.
  virtual float loss_gradient_scale() const { return 1.0f; }
  // Called right after each backward; on return every gradient is final.
  virtual void after_backward() = 0;
  // One line for logs.
  virtual std::string describe() const = 0;
  // After the after_backward of a synchronized micro-batch: the maximum of the stop
  // votes all ranks passed with it (Note [Agreeing to stop]); 0 before the first.
  virtual int64_t agreed_stop_vote() const = 0;
};

// The world-of-one synchronizer (see the Note).
class LocalGradients final : public GradientSynchronizer {
 public:
  void attach(models::Module& model) override;
  void before_backward(const MicroBatchInfo& micro_batch) override;
  void after_backward() override;
  std::string describe() const override;
  int64_t agreed_stop_vote() const override { return stop_vote_; }

 private:
  void on_gradient_ready(const models::Parameter& param);

  int64_t stop_vote_ = 0;

  std::vector<std::string> names_;  // by Parameter::index
  std::vector<int> ready_count_;    // hook calls per parameter in the current backward
};

}  // namespace mtrain
