#include "trainer/loop/train_loop.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/trace.h"
#include "models/loss.h"
#include "tensor/ops.h"
#include "trainer/loop/compute_timer.h"
#include "trainer/loop/device_batches.h"
#include "trainer/loop/metrics.h"
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
                     data::DataLoader& train_loader, data::DataLoader* test_loader,
                     MetricsWriter& metrics, TrainLoopConfig config)
    : model_(model),
      optimizer_(optimizer),
      sync_(sync),
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
// training totals so far. The samplers are deterministic given seed and epoch, so a resumed run
// starts that epoch's loader again and discards the micro-batches of the steps already done
// (assembling a batch costs far less than a step, and the data layer needs no seek); the
// learning-rate schedule depends only on the position. With the model, buffers and momentum
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
// sharded epoch has.
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
// reducer.cpp); after the exchange and before the optimizer step every rank raises the
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
TrainResult TrainLoop::run() {
  TrainResult result;
  models::CrossEntropyLoss loss_fn;
  DeviceBatches batches(train_loader_, config_.device);

  // Time is summed per step (waiting for the batch included, evaluation and logging
  // excluded), so a progress window may span an epoch boundary without counting the
  // evaluation in between as training time.
  ProgressWindow window;
  const int64_t accum = config_.grad_accum;
  MTRAIN_CHECK(accum >= 1, "grad_accum {} < 1", accum);
  const TrainPosition& start = config_.start;
  MTRAIN_CHECK(start.epoch >= 1 && start.steps_in_epoch >= 0 && start.total_steps >= start.steps_in_epoch,
               "start position epoch {} step {} (total {})", start.epoch, start.steps_in_epoch, start.total_steps);
  total_steps_ = start.total_steps;
  result.end = start;
  MTRAIN_CHECK(!config_.time_compute || accum == 1, "timing compute per step needs grad_accum 1, found {}", accum);
  std::optional<ComputeTimer> timer;
  if (config_.time_compute) timer.emplace(config_.device, model_);
  LossScaler* const scaler = config_.loss_scaler;
  std::vector<Tensor*> grads;  // what the scaler unscales
  if (scaler != nullptr) {
    if (start.loss_scaler.scale > 0.0) scaler->restore(start.loss_scaler);
    for (const models::NamedParameter& p : model_.parameters()) grads.push_back(&p.param->grad);
  }
  for (int64_t epoch = start.epoch; epoch <= config_.epochs; ++epoch) {
    // Note [Resuming mid-epoch]
    const bool resumed = epoch == start.epoch && (start.steps_in_epoch > 0 || start.epoch_finished);
    model_.train();
    // The sampler's epoch is 0-based (seed + epoch, as PyTorch); the printed one 1-based.
    batches.start_epoch(epoch - 1);
    // Note [Resuming in another world]: a resumed epoch's loader may hold only its rest.
    const bool rest = resumed && config_.start_holds_rest_only;
    const int64_t epoch_batches = batches.num_batches();
    const int64_t steps_per_epoch = (rest ? start.steps_in_epoch : 0) + mtrain::steps_per_epoch(epoch_batches, accum);
    MTRAIN_CHECK(!resumed || start.steps_in_epoch <= steps_per_epoch, "start position epoch {} step {} of {}",
                 start.epoch, start.steps_in_epoch, steps_per_epoch);
    if (resumed && start.epoch_finished && start.steps_in_epoch >= steps_per_epoch) continue;
    if (!resumed && step_limit_reached()) break;
    EpochSummary s;
    s.epoch = epoch;
    int64_t micro = 0;  // micro-batches taken this epoch
    if (resumed) {
      s.steps = start.steps_in_epoch;
      if (!start.epoch_finished) {
        s.loss_sum = start.loss_sum;
        s.correct = start.correct;
        s.images = start.images;
        s.train_seconds = start.train_seconds;
      }
      const int64_t done = rest ? 0 : std::min(start.steps_in_epoch * accum, epoch_batches);
      for (; micro < done; ++micro) {
        // Through `batches` too, so the prefetcher stays in step with the loader (a copy
        // to the device per skipped batch, once per resumed run).
        MTRAIN_CHECK(batches.next().has_value(), "epoch {} ended after {} of the {} batches to skip",
                     epoch, micro, done);
      }
    }
    const auto position = [&](bool finished) {
      TrainPosition p;
      p.epoch = epoch;
      p.steps_in_epoch = s.steps;
      p.total_steps = total_steps_;
      p.epoch_finished = finished;
      p.world_size = config_.world_size;
      // The steps of this epoch this run took, after those the checkpoint's world took.
      const int64_t base_steps = resumed ? start.steps_in_epoch : 0;
      const int64_t base_consumed = resumed && start.epoch_consumed >= 0 ? start.epoch_consumed
                                                                          : base_steps * config_.items_per_step;
      p.epoch_consumed = base_consumed + (s.steps - base_steps) * config_.items_per_step;
      if (scaler != nullptr) p.loss_scaler = scaler->state();
      if (!finished) {
        p.loss_sum = s.loss_sum;
        p.correct = s.correct;
        p.images = s.images;
        p.train_seconds = s.train_seconds;
      }
      return p;
    };
    if (config_.progress != nullptr) config_.progress->begin_epoch(s.steps);
    double step_seconds = 0.0;
    std::string divergence;      // this rank's non-finite loss (Note [Agreeing to diverge])
    double step_loss_sum = 0.0;  // per-image losses of this step's micro-batches
    int64_t step_images = 0;

    Clock::time_point step_start;
    while (!step_limit_reached()) {
      const auto micro_start = Clock::now();
      const bool first_of_step = micro % accum == 0;
      if (first_of_step) {
        trace::set_recording(config_.trace_steps.contains(total_steps_ + 1));
        step_start = micro_start;
      }
      auto batch = [&] {
        const trace::Span span("data wait", "data");
        return batches.next();
      }();
      if (!batch) break;
      const bool last_of_step = (micro + 1) % accum == 0 || micro + 1 == epoch_batches;
      ++micro;
      if (first_of_step) {
        optimizer_.zero_grad();
        if (config_.lr_schedule != nullptr) {
          const double progress = static_cast<double>(epoch - 1) + static_cast<double>(s.steps) /
                                  static_cast<double>(std::max<int64_t>(steps_per_epoch, 1));
          optimizer_.set_lr(static_cast<float>(config_.lr_schedule->at(progress)));
        }
      }
      MicroBatchInfo info{batch->size(), last_of_step};
      if (config_.hooks.world_samples) info.world_samples = config_.hooks.world_samples(batch->batch_index);
      // Note [Buffers follow rank 0]: every rank, its micro-batch empty or not.
      if (last_of_step && config_.hooks.sync_buffers) {
        const trace::Span span("buffer broadcast", "comm");
        config_.hooks.sync_buffers();
      }
      if (last_of_step && config_.hooks.stop_vote) info.stop_vote = config_.hooks.stop_vote();
      if (batch->size() == 0) {
        // An empty shard (see Note [Gradients are views into the buckets] in reducer.cpp): nothing
        // to compute, but the synchronizer still takes part in the exchange.
        if (timer) {
          timer->start();
          timer->pause();
          info.previous_compute = timer->previous();
          timer->resume();
          timer->stop(0);
        }
        sync_.before_backward(info);
        const trace::Span span("gradient sync wait", "comm");
        sync_.after_backward();
      } else {
        if (timer) timer->start();
        const models::LossResult r = [&] {
          const trace::Span span("forward", "compute", "images", batch->size());
          const Tensor logits = model_.forward(batch->images);
          return loss_fn.forward(logits, batch->labels);
        }();
        // Note [Agreeing to diverge]
        if (!std::isfinite(r.loss) && divergence.empty()) {
          divergence = fmt::format("the loss is {} at epoch {} step {}", r.loss, epoch, total_steps_ + 1);
        }
        if (last_of_step && !divergence.empty()) info.stop_vote = encode_stop_vote(kDivergedVote, config_.rank);
        Tensor dlogits = loss_fn.backward();
        if (accum > 1) ops::scale_(dlogits, 1.0f / static_cast<float>(accum));
        if (timer) {
          timer->pause();  // the collectives of before_backward are not compute
          info.previous_compute = timer->previous();
        }
        sync_.before_backward(info);
        float k = sync_.loss_gradient_scale();
        if (scaler != nullptr) k *= scaler->scale();
        if (k != 1.0f) ops::scale_(dlogits, k);
        if (timer) timer->resume();
        {
          const trace::Span span("backward", "compute");
          model_.backward(dlogits);
        }
        if (timer) timer->stop(batch->size());
        {
          const trace::Span span("gradient sync wait", "comm");
          sync_.after_backward();
        }
        s.images += r.count;
        s.loss_sum += r.loss * static_cast<double>(r.count);
        s.correct += r.correct;
        step_loss_sum += r.loss * static_cast<double>(r.count);
        step_images += r.count;
      }
      if (!last_of_step) {
        step_seconds += seconds_since(micro_start);
        continue;
      }
      if (const StopVote vote = decode_stop_vote(sync_.agreed_stop_vote()); vote.signal == kDivergedVote) {
        // Note [Agreeing to diverge]
        throw InvalidArgument(
            !divergence.empty()
                ? fmt::format("training diverged: {} (try a smaller --lr than {})", divergence, optimizer_.lr())
                : fmt::format("training diverged on rank {} at epoch {} step {}: its loss was not finite, so "
                              "every rank stops (try a smaller --lr than {})",
                              vote.rank, epoch, total_steps_ + 1, optimizer_.lr()));
      }
      // Note [Dynamic loss scaling]: every rank holds the same reduced gradients, so
      // every rank skips the same steps.
      {
        const trace::Span span("optimizer", "compute");
        const bool skip = scaler != nullptr && scaler->unscale_and_update(grads);
        if (!skip) optimizer_.step();
      }
      step_seconds += seconds_since(micro_start);

      ++total_steps_;
      ++s.steps;
      s.train_seconds += step_seconds;
      window.loss_sum += step_images > 0 ? step_loss_sum / static_cast<double>(step_images) : 0.0;
      ++window.steps;
      window.images += step_images;
      window.seconds += step_seconds;
      step_seconds = 0.0;
      step_loss_sum = 0.0;
      step_images = 0;
      if (config_.steps_done != nullptr) config_.steps_done->store(total_steps_);
      if (config_.hooks.after_step) config_.hooks.after_step(total_steps_);
      if (config_.hooks.plan_batches) config_.hooks.plan_batches(total_steps_, micro);
      trace::record("step", "step", trace::kTrainRow, step_start, Clock::now(), "step", total_steps_);
      // A --log-every step prints its own line just below.
      if (config_.progress != nullptr && total_steps_ % config_.log_every != 0) {
        config_.progress->step(epoch, s.steps, steps_per_epoch, total_steps_,
                               window.loss_sum / static_cast<double>(window.steps),
                               rate(static_cast<double>(window.images), window.seconds));
      }

      if (total_steps_ % config_.log_every == 0) {
        const double mean_loss = window.loss_sum / static_cast<double>(window.steps);
        const double img_per_s = rate(static_cast<double>(window.images), window.seconds);
        spdlog::info("epoch {} step {}/{} (total {}): loss {:.4f}, {:.0f} img/s", epoch, s.steps,
                     steps_per_epoch, total_steps_, mean_loss, img_per_s);
        if (config_.progress != nullptr) config_.progress->logged();
        nlohmann::json event = {{"event", "step"},
                                {"epoch", epoch},
                                {"step", total_steps_},
                                {"loss", json_number(mean_loss)},
                                {"lr", optimizer_.lr()},
                                {"img_per_s", json_number(img_per_s)},
                                {"images", window.images},
                                {"sec", window.seconds}};
        if (scaler != nullptr) {
          event["loss_scale"] = scaler->state().scale;
          event["skipped_steps"] = scaler->state().skipped_steps;
        }
        if (config_.hooks.extend_metrics) config_.hooks.extend_metrics(event);
        metrics_.write(event);
        window.reset();
      }

      // Every rank read the same agreed vote after this step (Note [Agreeing to stop]).
      if (const int64_t vote = sync_.agreed_stop_vote(); vote != 0) {
        result.end = position(false);
        result.stop_vote = vote;
        checkpoint(result.end, CheckpointReason::kStop);
        return result;
      }
      // The epoch's last step is followed by its own checkpoint, after the evaluation.
      const bool epoch_ends = micro == epoch_batches || step_limit_reached();
      if (config_.checkpoint_every > 0 && total_steps_ % config_.checkpoint_every == 0 && !epoch_ends) {
        checkpoint(position(false), CheckpointReason::kEvery);
      }
    }
    s.total_steps = total_steps_;
    if (s.steps == 0) break;  // max_steps hit exactly at the previous epoch's end
    result.end = position(false);
    if (config_.hooks.combine_epoch) config_.hooks.combine_epoch(s);
    if (s.images == 0) break;
    s.train_loss = s.loss_sum / static_cast<double>(s.images);
    s.train_acc = static_cast<double>(s.correct) / static_cast<double>(s.images);
    s.images_per_second = rate(static_cast<double>(s.images), s.train_seconds);

    if (test_loader_ != nullptr) {
      trace::set_recording(true);  // evaluations are traced outside --trace-steps too
      const trace::Span span("evaluation", "compute", "epoch", epoch);
      const auto eval_start = Clock::now();
      if (config_.hooks.sync_buffers) config_.hooks.sync_buffers();  // Note [Buffers follow rank 0]
      s.test = evaluate(model_, *test_loader_, config_.device, [&](int64_t done, int64_t batches) {
        if (config_.progress != nullptr) config_.progress->eval_batch(epoch, done, batches);
      });
      if (config_.hooks.combine_eval) s.test = config_.hooks.combine_eval(*s.test);
      s.eval_seconds = seconds_since(eval_start);
    }
    if (config_.progress != nullptr) config_.progress->end_epoch();
    spdlog::info("{}", format_epoch_line(s, config_.devices));
    if (config_.progress != nullptr) config_.progress->logged();
    // What this event's figures cover: after a resume past an epoch summarised at a
    // --max-steps cut, only the steps since (Note [Resuming mid-epoch]).
    const int64_t first_counted = resumed && start.epoch_finished ? start.steps_in_epoch : 0;
    const bool partial = first_counted > 0 || micro < epoch_batches;
    nlohmann::json event = {{"event", "epoch"},
                            {"epoch", epoch},
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
    metrics_.write(event);
    result.epochs.push_back(s);
    result.end = position(true);
    checkpoint(result.end, CheckpointReason::kEpochEnd);
    if (config_.hooks.after_epoch) config_.hooks.after_epoch(s);
  }
  return result;
}

}  // namespace mtrain
