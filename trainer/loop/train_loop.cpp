#include "trainer/loop/train_loop.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "core/error.h"
#include "core/trace.h"
#include "models/loss.h"
#include "tensor/ops.h"
#include "trainer/loop/compute_timer.h"
#include "trainer/loop/device_batches.h"
#include "trainer/loop/metrics.h"
#include "trainer/loop/step_graph.h"
#include "trainer/stopping/stop_signals.h"

namespace mtrain {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double rate(double amount, double seconds) { return seconds > 0 ? amount / seconds : 0.0; }

// Loss and throughput since the previous progress line.
struct ProgressWindow {
  double loss_sum = 0.0;  // sum of per-step mean losses
  int64_t steps = 0;
  int64_t images = 0;
  double seconds = 0.0;

  void reset() { *this = ProgressWindow{}; }
};

}  // namespace

std::string format_epoch_line(const EpochSummary& s, const std::vector<std::string>& devices) {
  std::string line = fmt::format("epoch {}, loss {:.3f}, train acc {:.3f}", s.epoch, s.train_loss, s.train_acc);
  if (s.test) line += fmt::format(", test acc {:.3f}", s.test->accuracy());
  line += fmt::format(", {:.1f} sec/epoch, {:.0f} img/s on [{}]", s.train_seconds, s.images_per_second,
                      fmt::join(devices, ", "));
  return line;
}

TrainLoop::TrainLoop(models::Module& model, models::Sgd& optimizer, GradientSynchronizer& sync,
                     StepExchange& exchange, data::DataLoader& train_loader, data::DataLoader* test_loader,
                     MetricsWriter& metrics, TrainLoopConfig config)
    : model_(model),
      optimizer_(optimizer),
      sync_(sync),
      exchange_(exchange),
      train_loader_(train_loader),
      test_loader_(test_loader),
      metrics_(metrics),
      config_(std::move(config)) {}

bool TrainLoop::step_limit_reached() const {
  return config_.max_steps && total_steps_ >= *config_.max_steps;
}

void TrainLoop::checkpoint(const TrainPosition& position, CheckpointReason reason) const {
  if (!config_.hooks.checkpoint) return;
  trace::set_recording(true);  // checkpoints are traced outside --trace-steps too
  const trace::Span span("checkpoint", "io", "step", position.total_steps);
  config_.hooks.checkpoint(position, reason);
}

// Note [Resuming mid-epoch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint records the epoch, the optimizer steps done in it and in total, and the epoch's
// training totals so far. The samplers are deterministic given seed and epoch, and an image's
// random transform depends only on (seed, epoch, index), so a resumed run starts that epoch's
// loader at the first micro-batch not yet trained on: those before it are never read nor decoded
// (for a streamed set they may be an hour of decoding); the learning-rate schedule depends only on
// the position. With the model, buffers and momentum
// restored, every later step computes exactly what the uninterrupted run computed. The totals are
// the whole world's (the checkpoint hook all-reduces them before saving), restored on rank 0 only,
// so the epoch's combine_epoch sum, and its summary line, cover the whole epoch. A checkpoint taken
// after the epoch's last step but before its summary (a stop) resumes into that summary and
// evaluation without training. An epoch that --max-steps cut short was summarised, yet has steps
// left: a run resumed with a larger --max-steps (or --epochs) continues it, and its next summary
// covers the steps run since.
//
// Note [Resuming in another world]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint may be resumed by another number of ranks (a node lost or gained, issue 26).
// Each position records the world that wrote it and how many items of the epoch's order its
// steps took, all ranks together (items_per_step per step: batch x grad_accum x world, or
// the global batch). With --global-batch-size a step takes the same G items whatever the
// world, so the steps of the new world are the old world's steps, and the resume skips
// batches as above. With a per-rank --batch-size the new world's steps are another size:
// the sampler then shards only what the epoch has left (Note [The rest of an epoch in
// another world] in data/distributed_sampler.cpp), the loader's first epoch holds just
// that, and the epoch's step count is the steps done plus the rest's. Either way every
// item of the epoch is trained on once, and no item twice beyond the padding every
// sharded epoch has. A streamed set's ranks read shards of their own, so what an epoch has
// left depends on every world that took part of it: each position lists the earlier worlds
// (earlier_segments), and the shard sampler replays them (Note [An epoch of shards in
// several worlds] in data/shard_sampler.cpp). An epoch begun in another world always
// continues this way, also when this run's world is the checkpoint's.
//
// Note [Buffers follow rank 0]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Without SyncBatchNorm each rank updates BatchNorm's running statistics from its own batches, so
// the replicas' buffers drift apart while their parameters stay equal. As PyTorch's DDP with
// broadcast_buffers=True, rank 0's buffers are broadcast to every rank before the forward of each
// micro-batch whose gradients are synchronized (with --grad-accum K, the K-th), and, beyond DDP,
// once more before the distributed evaluation, so every rank scores its share of the test set with
// the model rank 0 saves (--save-final, checkpoints) and the printed accuracy is that model's. With
// --sync-bn the buffers are equal on every rank already and nothing is sent. One broadcast per
// dtype per step (the float statistics, the int64 batch counters): 31 KiB for resnet18.
//
// Note [Agreeing to diverge]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A loss that is not finite ends the run with "training diverged". One rank's loss can go first
// (its batch), or a rank may have no batch at all, so a rank that stopped on its own would leave
// the others waiting in the step's collectives until the timeout or the launcher's teardown.
// Instead the rank finishes the step's backward (its gradients are NaN, harmlessly: nothing is
// applied) and casts kDivergedVote in the step's stop vote (Note [Agreeing to stop] in
// ddp/step_exchange.cpp); after the exchange and before the optimizer step every rank raises the
// divergence, naming the lowest rank whose loss was not finite, and the weights stay those of the
// step before.
//
// Note [Micro-batches per step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With --grad-accum K, one optimizer step consumes K micro-batches: gradients are zeroed before
// the first, accumulate over all K (communication only on the K-th, no_sync semantics), and the
// loss gradient of each is scaled by 1/K so the step equals one on the K micro-batches combined
// (the mean of K means of equal size). An epoch whose batch count is not a multiple of K ends with
// a shorter group, still scaled by 1/K (as a plain PyTorch accumulation loop does). Progress,
// max_steps and the lr schedule count optimizer steps; images count every micro-batch.

// What one run carries from epoch to epoch.
struct TrainLoop::RunState {
  RunState(data::DataLoader& loader, Device device) : batches(loader, device) {}

  TrainResult result;
  models::CrossEntropyLoss loss_fn;
  DeviceBatches batches;
  // Time is summed per step (waiting for the batch included, evaluation and logging
  // excluded), so a progress window may span an epoch boundary without counting the
  // evaluation in between as training time.
  ProgressWindow window;
  int64_t accum = 1;
  std::optional<ComputeTimer> timer;
  LossScaler* scaler = nullptr;
  std::vector<Tensor*> grads;  // what the scaler unscales
  std::optional<StepGraph> graph;  // --cuda-graphs, where the run can capture its steps
};

// One epoch's plan and totals.
struct TrainLoop::EpochState {
  int64_t epoch = 0;
  bool resumed = false;  // Note [Resuming mid-epoch]
  bool rest = false;     // Note [Resuming in another world]: the loader holds only the epoch's rest
  int64_t epoch_batches = 0;
  int64_t steps_per_epoch = 0;
  EpochSummary summary;
  int64_t micro = 0;  // micro-batches taken this epoch
  // This rank's first non-finite loss of the epoch (Note [Agreeing to diverge]); it is
  // voted with the step it happened in, or with the next step this rank computes.
  std::string divergence;
};

// One optimizer step's micro-batches (Note [Micro-batches per step]).
struct TrainLoop::StepState {
  Clock::time_point start;
  double seconds = 0.0;
  double loss_sum = 0.0;   // per-image losses of the step's micro-batches
  int64_t images = 0;
};

TrainResult TrainLoop::run() {
  RunState rs(train_loader_, config_.device);
  begin_run(rs);
  for (int64_t epoch = config_.start.epoch; epoch <= config_.epochs; ++epoch) {
    EpochState e;
    const EpochStart begun = begin_epoch(rs, epoch, e);
    if (begun == EpochStart::kAlreadyDone) continue;
    if (begun == EpochStart::kStepLimit) break;
    if (train_epoch(rs, e)) return rs.result;  // the ranks agreed to stop
    if (!finish_epoch(rs, e)) break;
  }
  return rs.result;
}

void TrainLoop::begin_run(RunState& rs) {
  rs.accum = config_.grad_accum;
  MTRAIN_CHECK(rs.accum >= 1, "grad_accum {} < 1", rs.accum);
  const TrainPosition& start = config_.start;
  MTRAIN_CHECK(start.epoch >= 1 && start.steps_in_epoch >= 0 && start.total_steps >= start.steps_in_epoch,
               "start position epoch {} step {} (total {})", start.epoch, start.steps_in_epoch, start.total_steps);
  total_steps_ = start.total_steps;
  rs.result.end = start;
  MTRAIN_CHECK(!config_.time_compute || rs.accum == 1, "timing compute per step needs grad_accum 1, found {}",
               rs.accum);
  if (config_.time_compute) rs.timer.emplace(config_.device, model_);
  rs.scaler = config_.loss_scaler;
  if (rs.scaler != nullptr) {
    if (start.loss_scaler.scale > 0.0) rs.scaler->restore(start.loss_scaler);
    for (const models::NamedParameter& p : model_.parameters()) rs.grads.push_back(&p.param->grad);
  }
  if (config_.cuda_graphs) {
    const StepGraphSettings settings{config_.device, rs.accum, rs.scaler != nullptr, config_.time_compute};
    if (const std::string why = step_graph_unsupported(settings, model_, sync_); !why.empty()) {
      spdlog::info("--cuda-graphs: not used: {}", why);
    } else {
      rs.graph.emplace(config_.device);
    }
  }
}

// Plans the epoch; a resumed one takes back its totals and skips the batches of the steps
// already done (Note [Resuming mid-epoch]).
TrainLoop::EpochStart TrainLoop::begin_epoch(RunState& rs, int64_t epoch, EpochState& e) {
  const TrainPosition& start = config_.start;
  e.epoch = epoch;
  e.resumed = epoch == start.epoch && (start.steps_in_epoch > 0 || start.epoch_finished);
  e.rest = e.resumed && config_.start_holds_rest_only;
  model_.train();
  // The sampler's epoch is 0-based (seed + epoch, as PyTorch); the printed one 1-based. A
  // resumed epoch's loader passes over the micro-batches of the steps done, unassembled.
  const int64_t done = e.resumed && !e.rest ? start.steps_in_epoch * rs.accum : 0;
  rs.batches.start_epoch(epoch - 1, done);
  e.epoch_batches = rs.batches.num_batches();
  e.steps_per_epoch = (e.rest ? start.steps_in_epoch : 0) + mtrain::steps_per_epoch(e.epoch_batches, rs.accum);
  MTRAIN_CHECK(!e.resumed || start.steps_in_epoch <= e.steps_per_epoch, "start position epoch {} step {} of {}",
               start.epoch, start.steps_in_epoch, e.steps_per_epoch);
  if (e.resumed && start.epoch_finished && start.steps_in_epoch >= e.steps_per_epoch) return EpochStart::kAlreadyDone;
  if (!e.resumed && step_limit_reached()) return EpochStart::kStepLimit;
  e.summary.epoch = epoch;
  if (e.resumed) {
    e.summary.steps = start.steps_in_epoch;
    if (!start.epoch_finished) {
      e.summary.loss_sum = start.loss_sum;
      e.summary.correct = start.correct;
      e.summary.images = start.images;
      e.summary.train_seconds = start.train_seconds;
    }
    e.micro = std::min(done, e.epoch_batches);
  }
  if (config_.progress != nullptr) config_.progress->begin_epoch(e.summary.steps);
  return EpochStart::kTrain;
}

TrainPosition TrainLoop::position(const RunState& rs, const EpochState& e, bool finished) const {
  const TrainPosition& start = config_.start;
  TrainPosition p;
  p.epoch = e.epoch;
  p.steps_in_epoch = e.summary.steps;
  p.total_steps = total_steps_;
  p.epoch_finished = finished;
  p.world_size = config_.world_size;
  // The steps of this epoch this run took, after those the checkpoint's world took.
  const int64_t base_steps = e.resumed ? start.steps_in_epoch : 0;
  const int64_t base_consumed =
      e.resumed && start.epoch_consumed >= 0 ? start.epoch_consumed : base_steps * config_.items_per_step;
  p.epoch_consumed = base_consumed + (e.summary.steps - base_steps) * config_.items_per_step;
  if (e.resumed) p.earlier_segments = start.earlier_segments;
  if (rs.scaler != nullptr) p.loss_scaler = rs.scaler->state();
  if (!finished) {
    p.loss_sum = e.summary.loss_sum;
    p.correct = e.summary.correct;
    p.images = e.summary.images;
    p.train_seconds = e.summary.train_seconds;
  }
  return p;
}

bool TrainLoop::train_epoch(RunState& rs, EpochState& e) {
  StepState step;
  while (!step_limit_reached()) {
    const auto micro_start = Clock::now();
    const bool first_of_step = e.micro % rs.accum == 0;
    if (first_of_step) {
      trace::set_recording(config_.trace_steps.contains(total_steps_ + 1));
      step.start = micro_start;
    }
    auto batch = [&] {
      const trace::Span span("data wait", "data");
      return rs.batches.next();
    }();
    if (!batch) break;
    const bool last_of_step = (e.micro + 1) % rs.accum == 0 || e.micro + 1 == e.epoch_batches;
    ++e.micro;
    if (first_of_step) begin_step(e);
    train_micro_batch(rs, e, step, *batch, last_of_step);
    if (!last_of_step) {
      step.seconds += seconds_since(micro_start);
      continue;
    }
    apply_step(rs, e);
    step.seconds += seconds_since(micro_start);
    record_step(rs, e, step);
    if (stop_agreed(rs, e)) return true;
    checkpoint_if_due(rs, e);
  }
  return false;
}

// The first micro-batch of a step: fresh gradients, the schedule's learning rate.
void TrainLoop::begin_step(const EpochState& e) {
  sync_.zero_gradients();
  if (config_.fresh_gradients) models::mark_gradients_fresh(model_);
  if (config_.lr_schedule == nullptr) return;
  const double steps = static_cast<double>(std::max<int64_t>(e.steps_per_epoch, 1));
  const double progress = static_cast<double>(e.epoch - 1) + static_cast<double>(e.summary.steps) / steps;
  optimizer_.set_lr(static_cast<float>(config_.lr_schedule->at(progress)));
}

void TrainLoop::train_micro_batch(RunState& rs, EpochState& e, StepState& step, const data::Batch& batch,
                                  bool last_of_step) {
  MicroBatchInfo info{batch.size(), last_of_step};
  if (config_.hooks.world_samples) info.world_samples = config_.hooks.world_samples(batch.batch_index);
  // Note [Buffers follow rank 0]: every rank, its micro-batch empty or not.
  if (last_of_step && config_.hooks.sync_buffers) {
    const trace::Span span("buffer broadcast", "comm");
    config_.hooks.sync_buffers();
  }
  StepReport report;
  if (last_of_step && config_.hooks.stop_vote) report.stop_vote = config_.hooks.stop_vote();
  if (batch.size() == 0) {
    // An empty shard (see Note [Gradients are views into the buckets] in reducer.cpp): nothing
    // to compute, but the synchronizer still takes part in the collectives, in their order.
    if (rs.timer) {
      rs.timer->start();
      rs.timer->stop(0);
      report.previous_compute = rs.timer->previous();
    }
    synchronize_backward(info, [&] { sync_.skip_backward(); }, [&] { send_report(report, info); });
    return;
  }
  const models::LossResult r = forward_backward(rs, e, batch, info, report);
  e.summary.images += r.count;
  e.summary.loss_sum += r.loss * static_cast<double>(r.count);
  e.summary.correct += r.correct;
  step.loss_sum += r.loss * static_cast<double>(r.count);
  step.images += r.count;
}

// Note [The loss is read after backward is queued]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The step needs its loss before the optimizer (a rank whose loss is not finite votes to
// stop, Note [Agreeing to diverge]), and the vote travels in the step's exchange (Note
// [Agreeing to stop] in trainer/ddp/step_exchange.cpp), but the backward needs neither. From
// a GPU (Note [Loss statistics stay on the device] in models/loss.cpp) the loss is therefore
// read once the backward is queued: the host waits for the forward alone while the GPU has
// the whole backward before it, and the exchange travels while that backward runs. Read
// before the backward, the loss left the GPU idle from the forward's end until the host had
// queued the backward's first kernels.
// On the CPU the loss is on the host when the forward returns, and is read then. Where the
// exchange goes, before or after the backward, its own unit decides for every rank (Note
// [The exchange's place in the step] in trainer/ddp/step_exchange.cpp); synchronize_backward
// follows it, for an empty micro-batch too. The previous step's compute time is read with the
// loss: by then the stream has passed that step's marks (Note [Timing on a GPU] in
// compute_timer.cpp). A label outside [0, K) is reported where the loss is read, from a GPU
// after a backward whose gradients are never applied.
models::LossResult TrainLoop::forward_backward(RunState& rs, EpochState& e, const data::Batch& batch,
                                               const MicroBatchInfo& info, StepReport& report) {
  if (rs.graph && rs.graph->takes(batch)) {
    if (std::optional<models::LossResult> r = replay_forward_backward(rs, e, batch, info, report)) return *r;
  }
  if (rs.timer) rs.timer->start();
  const models::PendingLoss pending = [&] {
    const trace::Span span("forward", "compute", "images", batch.size());
    const Tensor logits = model_.forward(batch.images);
    return rs.loss_fn.forward(logits, batch.labels);
  }();
  Tensor dlogits = rs.loss_fn.backward();
  if (rs.accum > 1) ops::scale_(dlogits, 1.0f / static_cast<float>(rs.accum));
  if (rs.timer) rs.timer->pause();  // the synchronizer's work is not compute
  const auto backward = [&] {
    float k = sync_.loss_gradient_scale();
    if (rs.scaler != nullptr) k *= rs.scaler->scale();
    if (k != 1.0f) ops::scale_(dlogits, k);
    if (rs.timer) rs.timer->resume();
    {
      const trace::Span span("backward", "compute");
      model_.backward(dlogits);
    }
    if (rs.timer) rs.timer->stop(batch.size());
  };
  models::LossResult r;
  synchronize_backward(info, backward, [&] { r = read_and_report(rs, e, pending, info, report); });
  return r;
}

// forward_backward from the step's graph (Note [A captured training step] in
// step_graph.cpp), with the synchronizer's and the exchange's calls around it; nullopt when
// the graph could not be captured and nothing ran. A world of one, where the exchange's
// place in the step (before or after the backward) is nobody else's concern: the report
// goes once the graph is queued, as Note [The loss is read after backward is queued] has it.
std::optional<models::LossResult> TrainLoop::replay_forward_backward(RunState& rs, EpochState& e,
                                                                     const data::Batch& batch,
                                                                     const MicroBatchInfo& info, StepReport& report) {
  sync_.before_backward(info);
  const models::PendingLoss* pending = rs.graph->run(
      batch,
      [&](const Tensor& images, const Tensor& labels) { return rs.loss_fn.forward(model_.forward(images), labels); },
      [&] { model_.backward(rs.loss_fn.backward()); }, [&] { sync_.backward_replayed(); });
  if (pending == nullptr) {
    // The capture's backward consumed the marks it ran past; the step runs as without.
    if (config_.fresh_gradients) models::mark_gradients_fresh(model_);
    return std::nullopt;
  }
  const models::LossResult r = read_and_report(rs, e, *pending, info, report);
  {
    const trace::Span span("gradient sync wait", "comm");
    sync_.after_backward();
  }
  if (info.sync) exchange_.finish();
  return r;
}

// The synchronizer's and the exchange's calls around one micro-batch's backward (or its skip),
// in the order every rank makes them (Note [The exchange's place in the step] in
// trainer/ddp/step_exchange.cpp).
void TrainLoop::synchronize_backward(const MicroBatchInfo& info, const std::function<void()>& backward,
                                     const std::function<void()>& report) {
  sync_.before_backward(info);
  if (!exchange_.issued_after_backward()) report();
  backward();
  if (exchange_.issued_after_backward()) report();
  const trace::Span span("gradient sync wait", "comm");
  sync_.after_backward();
  if (info.sync) exchange_.finish();
}

// A synchronized micro-batch sends this rank's record; the others send nothing.
void TrainLoop::send_report(const StepReport& report, const MicroBatchInfo& info) {
  if (info.sync) exchange_.issue(report, info, sync_.last_wait_ns());
}

// Reads the micro-batch's loss, adds a divergence to the report, and reports.
models::LossResult TrainLoop::read_and_report(RunState& rs, EpochState& e, const models::PendingLoss& pending,
                                              const MicroBatchInfo& info, StepReport& report) {
  const models::LossResult r = [&] {
    const trace::Span span("loss read", "compute");
    return pending.read();
  }();
  // Note [Agreeing to diverge]
  if (!std::isfinite(r.loss) && e.divergence.empty()) {
    e.divergence = fmt::format("the loss is {} at epoch {} step {}", r.loss, e.epoch, total_steps_ + 1);
  }
  if (info.sync && !e.divergence.empty()) report.stop_vote = encode_stop_vote(kDivergedVote, config_.rank);
  if (rs.timer) report.previous_compute = rs.timer->previous();
  send_report(report, info);
  return r;
}

// After the step's exchange: raise an agreed divergence, else update the weights.
void TrainLoop::apply_step(RunState& rs, const EpochState& e) {
  if (const StopVote vote = decode_stop_vote(exchange_.agreed_stop_vote()); vote.signal == kDivergedVote) {
    // Note [Agreeing to diverge]
    throw InvalidArgument(
        !e.divergence.empty()
            ? fmt::format("training diverged: {} (try a smaller --lr than {})", e.divergence, optimizer_.lr())
            : fmt::format("training diverged on rank {} at epoch {} step {}: its loss was not finite, so "
                          "every rank stops (try a smaller --lr than {})",
                          vote.rank, e.epoch, total_steps_ + 1, optimizer_.lr()));
  }
  // Note [Dynamic loss scaling]: every rank holds the same reduced gradients, so
  // every rank skips the same steps.
  const trace::Span span("optimizer", "compute");
  const bool skip = rs.scaler != nullptr && rs.scaler->unscale_and_update(rs.grads);
  if (!skip) optimizer_.step();
}

// The step's counters and hooks, its progress line or --log-every line and event; then a
// fresh StepState for the next step.
void TrainLoop::record_step(RunState& rs, EpochState& e, StepState& step) {
  ++total_steps_;
  ++e.summary.steps;
  e.summary.train_seconds += step.seconds;
  ProgressWindow& window = rs.window;
  window.loss_sum += step.images > 0 ? step.loss_sum / static_cast<double>(step.images) : 0.0;
  ++window.steps;
  window.images += step.images;
  window.seconds += step.seconds;
  const Clock::time_point step_start = step.start;
  step = StepState{};
  if (config_.steps_done != nullptr) config_.steps_done->store(total_steps_);
  if (config_.hooks.after_step) config_.hooks.after_step(total_steps_);
  if (config_.hooks.plan_batches) config_.hooks.plan_batches(total_steps_, e.micro);
  trace::record("step", "step", trace::kTrainRow, step_start, Clock::now(), "step", total_steps_);
  // A --log-every step prints its own line just below.
  if (config_.progress != nullptr && total_steps_ % config_.log_every != 0) {
    config_.progress->step(e.epoch, e.summary.steps, e.steps_per_epoch, total_steps_,
                           window.loss_sum / static_cast<double>(window.steps),
                           rate(static_cast<double>(window.images), window.seconds));
  }
  if (total_steps_ % config_.log_every == 0) log_window(rs, e);
}

void TrainLoop::log_window(RunState& rs, const EpochState& e) {
  ProgressWindow& window = rs.window;
  const double mean_loss = window.loss_sum / static_cast<double>(window.steps);
  const double img_per_s = rate(static_cast<double>(window.images), window.seconds);
  spdlog::info("epoch {} step {}/{} (total {}): loss {:.4f}, {:.0f} img/s", e.epoch, e.summary.steps, e.steps_per_epoch,
               total_steps_, mean_loss, img_per_s);
  if (config_.progress != nullptr) config_.progress->logged();
  nlohmann::json event = {{"event", "step"},
                          {"epoch", e.epoch},
                          {"step", total_steps_},
                          {"loss", json_number(mean_loss)},
                          {"lr", optimizer_.lr()},
                          {"img_per_s", json_number(img_per_s)},
                          {"images", window.images},
                          {"sec", window.seconds}};
  if (rs.scaler != nullptr) {
    event["loss_scale"] = rs.scaler->state().scale;
    event["skipped_steps"] = rs.scaler->state().skipped_steps;
  }
  if (config_.hooks.extend_metrics) config_.hooks.extend_metrics(event);
  metrics_.write(event);
  window.reset();
}

// After a step: true when the ranks agreed to stop (then checkpointed, the result set).
bool TrainLoop::stop_agreed(RunState& rs, const EpochState& e) {
  // Every rank read the same agreed vote after this step (Note [Agreeing to stop]).
  const int64_t vote = exchange_.agreed_stop_vote();
  if (vote == 0) return false;
  rs.result.end = position(rs, e, false);
  rs.result.stop_vote = vote;
  checkpoint(rs.result.end, CheckpointReason::kStop);
  return true;
}

void TrainLoop::checkpoint_if_due(const RunState& rs, const EpochState& e) {
  // The epoch's last step is followed by its own checkpoint, after the evaluation.
  const bool epoch_ends = e.micro == e.epoch_batches || step_limit_reached();
  if (config_.checkpoint_every > 0 && total_steps_ % config_.checkpoint_every == 0 && !epoch_ends) {
    checkpoint(position(rs, e, false), CheckpointReason::kEvery);
  }
}

// The epoch's summary: totals over the ranks, evaluation, line, event, checkpoint. False
// when there is nothing to summarise and the run ends.
bool TrainLoop::finish_epoch(RunState& rs, EpochState& e) {
  EpochSummary& s = e.summary;
  s.total_steps = total_steps_;
  if (s.steps == 0) return false;  // max_steps hit exactly at the previous epoch's end
  rs.result.end = position(rs, e, false);
  if (config_.hooks.combine_epoch) config_.hooks.combine_epoch(s);
  if (s.images == 0) return false;
  s.train_loss = s.loss_sum / static_cast<double>(s.images);
  s.train_acc = static_cast<double>(s.correct) / static_cast<double>(s.images);
  s.images_per_second = rate(static_cast<double>(s.images), s.train_seconds);
  if (test_loader_ != nullptr) evaluate_epoch(s);
  if (config_.progress != nullptr) config_.progress->end_epoch();
  spdlog::info("{}", format_epoch_line(s, config_.devices));
  if (config_.progress != nullptr) config_.progress->logged();
  metrics_.write(epoch_event(e));
  rs.result.epochs.push_back(s);
  rs.result.end = position(rs, e, true);
  checkpoint(rs.result.end, CheckpointReason::kEpochEnd);
  if (config_.hooks.after_epoch) config_.hooks.after_epoch(s);
  return true;
}

void TrainLoop::evaluate_epoch(EpochSummary& s) {
  trace::set_recording(true);  // evaluations are traced outside --trace-steps too
  const trace::Span span("evaluation", "compute", "epoch", s.epoch);
  const auto eval_start = Clock::now();
  if (config_.hooks.sync_buffers) config_.hooks.sync_buffers();  // Note [Buffers follow rank 0]
  s.test = evaluate(model_, *test_loader_, config_.device, [&](int64_t done, int64_t batches) {
    if (config_.progress != nullptr) config_.progress->eval_batch(s.epoch, done, batches);
  });
  if (config_.hooks.combine_eval) s.test = config_.hooks.combine_eval(*s.test);
  s.eval_seconds = seconds_since(eval_start);
}

nlohmann::json TrainLoop::epoch_event(const EpochState& e) const {
  const EpochSummary& s = e.summary;
  const TrainPosition& start = config_.start;
  // What this event's figures cover: after a resume past an epoch summarised at a
  // --max-steps cut, only the steps since (Note [Resuming mid-epoch]).
  const int64_t first_counted = e.resumed && start.epoch_finished ? start.steps_in_epoch : 0;
  const bool partial = first_counted > 0 || e.micro < e.epoch_batches;
  nlohmann::json event = {{"event", "epoch"},
                          {"epoch", e.epoch},
                          {"step", total_steps_},
                          {"steps", s.steps - first_counted},
                          {"images", s.images},
                          {"partial", partial},
                          {"train_loss", json_number(s.train_loss)},
                          {"train_acc", s.train_acc},
                          {"test_loss", s.test ? json_number(s.test->mean_loss()) : nullptr},
                          {"test_acc", s.test ? nlohmann::json(s.test->accuracy()) : nullptr},
                          {"sec", s.train_seconds},
                          {"eval_sec", s.eval_seconds},
                          {"img_per_s", json_number(s.images_per_second)},
                          {"devices", config_.devices}};
  add_memory_fields(event, config_.device);
  if (config_.hooks.extend_metrics) config_.hooks.extend_metrics(event);
  return event;
}

}  // namespace mtrain
