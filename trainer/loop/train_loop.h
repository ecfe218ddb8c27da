// The training loop: epochs of forward, loss, backward, gradient synchronization and SGD steps,
// progress lines every few steps and the d2l-style line after each epoch. It owns nothing: the
// caller builds the model, optimizer, loaders, synchronizer, step exchange and metrics writer (a
// distributed run passes a DistributedSampler, a Reducer and an exchange over its control group)
// and joins through TrainLoopHooks. run() drives
// every step from the calling thread. The why is in train_loop.cpp's Notes: [Resuming
// mid-epoch], [Buffers follow rank 0], [Agreeing to diverge], [Micro-batches per step].
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "data/dataloader.h"
#include "models/loss.h"
#include "models/module.h"
#include "models/optim.h"
#include "trainer/loop/evaluate.h"
#include "trainer/ddp/gradient_sync.h"
#include "trainer/ddp/step_exchange.h"
#include "trainer/loop/loss_scaler.h"
#include "trainer/loop/lr_schedule.h"
#include "trainer/loop/metrics.h"
#include "trainer/loop/progress.h"

namespace mtrain {

struct EpochSummary;
struct TrainPosition;

// Why the loop asks for a checkpoint.
enum class CheckpointReason {
  kEvery,     // --checkpoint-every N steps
  kEpochEnd,  // after an epoch's summary and evaluation
  kStop,      // the ranks agreed to stop (Note [Agreeing to stop] in ddp/step_exchange.cpp)
};

// Hooks through which a distributed run joins the loop without the loop knowing about
// process groups; each is optional.
struct TrainLoopHooks {
  // After every optimizer step (1-based step count), e.g. the replica check.
  std::function<void(int64_t step)> after_step;
  // After every optimizer step and after_step, with the micro-batches this epoch has taken
  // from the loader so far; may change how the epoch's later batches are split (--balance),
  // from batch batches_taken + 1 on (the device prefetcher may hold the next one).
  std::function<void(int64_t step, int64_t batches_taken)> plan_batches;
  // With --global-batch-size: the images every rank's batches of the epoch's batch
  // `batch_index` hold together, as the sampler plans them (MicroBatchInfo::world_samples).
  std::function<int64_t(int64_t batch_index)> world_samples;
  // Turns this rank's epoch totals into the whole world's (an all-reduce).
  std::function<void(EpochSummary& summary)> combine_epoch;
  // Turns this rank's evaluation sums into the whole world's.
  std::function<EvalResult(const EvalResult& local)> combine_eval;
  // Adds fields to each step and epoch metrics event (e.g. communication statistics).
  std::function<void(nlohmann::json& event)> extend_metrics;
  // This rank's stop vote (Note [Stop votes] in stop_signals.cpp), asked right before the
  // synchronizing backward of every step. Unset: never stops early.
  std::function<int64_t()> stop_vote;
  // Saves the run at `position` (a collective in a distributed run: every rank calls
  // it at the same step). Unset: no checkpoints.
  std::function<void(const TrainPosition& position, CheckpointReason reason)> checkpoint;
  // Overwrites this rank's buffers with rank 0's (Note [Buffers follow rank 0]); called
  // by every rank at the same points. Unset: buffers stay as each rank computes them.
  std::function<void()> sync_buffers;
  // After each epoch's metrics and checkpoint, with its summary (the whole world's
  // figures). Must not throw: an output that fails must not lose the run.
  std::function<void(const EpochSummary& summary)> after_epoch;
};

// A world that took part of an epoch before the one that holds the position: its ranks,
// and the items of the epoch it took, all its ranks together (Note [Resuming in another
// world]).
struct EpochSegment {
  int world_size = 1;
  int64_t consumed = 0;
  bool operator==(const EpochSegment&) const = default;
};

// Where a run stands: what a checkpoint records and a resumed run starts from (Note [Resuming
// mid-epoch]).
struct TrainPosition {
  int64_t epoch = 1;            // 1-based epoch in progress (or just finished)
  int64_t steps_in_epoch = 0;   // optimizer steps done in that epoch
  int64_t total_steps = 0;      // optimizer steps since the start of the run
  bool epoch_finished = false;  // the epoch's summary and evaluation happened too
  // The epoch's training totals so far (Note [Resuming mid-epoch]).
  double loss_sum = 0.0;
  int64_t correct = 0;
  int64_t images = 0;
  double train_seconds = 0.0;
  // The loss scaler's state (scale 0 without one; Note [Dynamic loss scaling] in loss_scaler.cpp).
  LossScalerState loss_scaler;
  // The world that got here, and how many items of the epoch's order its steps in the epoch
  // took, all ranks together: what a resume on another world size continues from (Note
  // [Resuming in another world]). epoch_consumed is -1 when a checkpoint from before it
  // was recorded is read.
  int world_size = 1;
  int64_t epoch_consumed = 0;
  // The epoch's earlier worlds, oldest first, when it was resumed in another world: a
  // streamed set's sampler replays them to know what the epoch has left
  // (data/shard_sampler.h). Their items are among epoch_consumed.
  std::vector<EpochSegment> earlier_segments;
};

// The optimizer steps (1-based over the run, inclusive) whose spans --trace records; the
// default records none. Evaluations and checkpoints are recorded whenever tracing started.
struct TraceSteps {
  int64_t first = 1;
  int64_t last = 0;
  bool contains(int64_t step) const { return step >= first && step <= last; }
};

struct TrainLoopConfig {
  int64_t epochs = 1;
  std::optional<int64_t> max_steps;  // optimizer steps over the whole run; unset = no limit
  int64_t log_every = 20;            // steps between progress lines and step events
  std::vector<std::string> devices{"cpu"};  // for the epoch line and metrics
  // Where the model lives: every batch goes there before forward (Note [Batches to
  // the device] in device_batches.cpp).
  Device device = Device::cpu();
  // Micro-batches per optimizer step (--grad-accum); see Note [Micro-batches per step] in
  // train_loop.cpp.
  int64_t grad_accum = 1;
  const LrSchedule* lr_schedule = nullptr;  // null: the optimizer's rate throughout
  TrainLoopHooks hooks;
  TrainPosition start;           // where to begin: the default is the very beginning
  int64_t checkpoint_every = 0;  // steps between kEvery checkpoints; 0 = none
  int rank = 0;                  // this process's rank, named in a divergence vote
  int world_size = 1;            // recorded in each position
  // Items of the epoch's order one optimizer step takes, over all ranks: batch x
  // grad_accum x world, or the global batch (Note [Resuming in another world]).
  int64_t items_per_step = 0;
  // The loader's epoch start.epoch holds only what the checkpoint's world left of it,
  // re-sharded (DistributedSampler::resume_epoch): nothing is skipped, and that epoch has
  // start.steps_in_epoch steps more than its batches make.
  bool start_holds_rest_only = false;
  // Scales the loss gradient and unscales the gradients, skipping steps that overflow
  // (Note [Dynamic loss scaling]); null: no loss scaling.
  LossScaler* loss_scaler = nullptr;
  // Reports every step and evaluation batch (Note [Progress that never goes quiet]);
  // null: only the --log-every lines.
  Progress* progress = nullptr;
  // The optimizer steps done so far, stored after each step for readers on other
  // threads (the stop signal's acknowledgement); null: not published.
  std::atomic<int64_t>* steps_done = nullptr;
  // The steps whose timeline the process's trace recorder keeps (core/trace.h); it
  // records nothing unless started.
  TraceSteps trace_steps;
  // Time each step's forward and backward (trainer/loop/compute_timer.h) and pass it to the
  // synchronizer with the next step (--balance); needs grad_accum 1.
  bool time_compute = false;
  // Mark the gradients fresh after zeroing them, so their first writer overwrites
  // (MTRAIN_SPEEDUPS=fresh-grads; Note [Gradient accumulation in modules] in
  // models/module.cpp).
  bool fresh_gradients = false;
  // Capture each micro-batch's forward, loss and backward as a CUDA graph and replay it
  // (--cuda-graphs; Note [A captured training step] in step_graph.cpp); where the run
  // cannot, one log line says why and the loop runs as without.
  bool cuda_graphs = false;
};

// Optimizer steps in an epoch of `batches` micro-batches, `grad_accum` per step (the
// last step takes what is left).
inline int64_t steps_per_epoch(int64_t batches, int64_t grad_accum) { return (batches + grad_accum - 1) / grad_accum; }

struct EpochSummary {
  int64_t epoch = 0;           // 1-based, as printed
  int64_t steps = 0;           // optimizer steps in this epoch
  int64_t total_steps = 0;     // optimizer steps since the start of the run
  int64_t images = 0;          // training images seen in this epoch
  double train_loss = 0.0;     // mean per-image loss over the epoch
  double train_acc = 0.0;
  std::optional<EvalResult> test;  // absent when there is no test loader
  double train_seconds = 0.0;  // sum of step times (batch wait, forward, backward, step)
  double eval_seconds = 0.0;
  double images_per_second = 0.0;  // images / train_seconds
  double loss_sum = 0.0;           // sum of per-image losses (train_loss * images)
  int64_t correct = 0;             // correctly classified training images
};

struct TrainResult {
  std::vector<EpochSummary> epochs;  // the epochs summarised by this run
  TrainPosition end;                 // where it stopped
  int64_t stop_vote = 0;             // the agreed stop vote; 0 when it ran to the end
};

// "epoch 1, loss 0.452, train acc 0.838, test acc 0.871, 13.3 sec/epoch, 4521 img/s on [cpu]"
// (without "test acc" when there was no evaluation).
std::string format_epoch_line(const EpochSummary& s, const std::vector<std::string>& devices);

class TrainLoop {
 public:
  // `test_loader` may be null (no evaluation). Everything must outlive the loop.
  TrainLoop(models::Module& model, models::Sgd& optimizer, GradientSynchronizer& sync, StepExchange& exchange,
            data::DataLoader& train_loader, data::DataLoader* test_loader, MetricsWriter& metrics,
            TrainLoopConfig config);

  // Runs from config.start until config.epochs epochs or config.max_steps steps,
  // whichever comes first (an epoch cut short by max_steps is still evaluated and
  // summarised), or until the ranks agree to stop (right after that step, without the
  // epoch's evaluation). Throws InvalidArgument when the loss stops being finite
  // (diverged; the message suggests a smaller --lr), on every rank after the same step (Note
  // [Agreeing to diverge]); the hooks' and the synchronizer's errors pass through.
  TrainResult run();

 private:
  // run() in phases: the run, each epoch, each optimizer step; the states are in the .cpp.
  struct RunState;
  struct EpochState;
  struct StepState;
  enum class EpochStart { kTrain, kAlreadyDone, kStepLimit };

  void begin_run(RunState& rs);
  EpochStart begin_epoch(RunState& rs, int64_t epoch, EpochState& e);
  // True when the ranks agreed to stop after one of its steps (rs.result is set).
  bool train_epoch(RunState& rs, EpochState& e);
  void begin_step(const EpochState& e);
  void train_micro_batch(RunState& rs, EpochState& e, StepState& step, const data::Batch& batch, bool last_of_step);
  models::LossResult forward_backward(RunState& rs, EpochState& e, const data::Batch& batch,
                                      const MicroBatchInfo& info, StepReport& report);
  std::optional<models::LossResult> replay_forward_backward(RunState& rs, EpochState& e, const data::Batch& batch,
                                                            const MicroBatchInfo& info, StepReport& report);
  void synchronize_backward(const MicroBatchInfo& info, const std::function<void()>& backward,
                            const std::function<void()>& report);
  void send_report(const StepReport& report, const MicroBatchInfo& info);
  models::LossResult read_and_report(RunState& rs, EpochState& e, const models::PendingLoss& pending,
                                     const MicroBatchInfo& info, StepReport& report);
  void apply_step(RunState& rs, const EpochState& e);
  void record_step(RunState& rs, EpochState& e, StepState& step);
  void log_window(RunState& rs, const EpochState& e);
  bool stop_agreed(RunState& rs, const EpochState& e);
  void checkpoint_if_due(const RunState& rs, const EpochState& e);
  bool finish_epoch(RunState& rs, EpochState& e);
  void evaluate_epoch(EpochSummary& s);
  nlohmann::json epoch_event(const EpochState& e) const;
  TrainPosition position(const RunState& rs, const EpochState& e, bool finished) const;
  bool step_limit_reached() const;
  void checkpoint(const TrainPosition& position, CheckpointReason reason) const;

  models::Module& model_;
  models::Sgd& optimizer_;
  GradientSynchronizer& sync_;
  StepExchange& exchange_;
  data::DataLoader& train_loader_;
  data::DataLoader* test_loader_;
  MetricsWriter& metrics_;
  TrainLoopConfig config_;
  int64_t total_steps_ = 0;
};

}  // namespace mtrain
