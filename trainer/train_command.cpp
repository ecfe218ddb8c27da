#include "trainer/train_command.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>

#include "core/error.h"
#include "core/trace.h"
#include "data/data_source.h"
#include "core/files.h"
#include "models/onnx/onnx_graph.h"
#include "models/sync_batchnorm.h"
#include "models/zoo.h"
#include "tensor/cuda_memory.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/ddp/rank_consensus.h"
#include "trainer/loop/evaluate.h"
#include "trainer/loop/progress.h"
#include "trainer/plot/curves.h"
#include "trainer/setup/start_up.h"
#include "trainer/stopping/error_file.h"
#include "trainer/stopping/stop_signals.h"
#include "trainer/trace/run_trace.h"

namespace mtrain {

namespace {

// Only rank 0 speaks at info level; the others report warnings and errors, prefixed
// with their rank so interleaved output stays attributable.
void configure_logging(spdlog::level::level_enum level, const WorkerEnvironment& env) {
  Progress::prepare_logging(Progress::mode_for(env.rank, level <= spdlog::level::info));
  if (env.rank == 0) {
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
    spdlog::set_level(level);
  } else {
    spdlog::set_pattern(fmt::format("[%Y-%m-%d %H:%M:%S.%e] [%l] [rank {}] %v", env.rank));
    spdlog::set_level(std::max(level, spdlog::level::warn));
  }
}

// Sums this rank's (loss_sum, correct, count) with every other rank's.
EvalResult allreduce_eval(ProcessGroup& group, const EvalResult& local) {
  Tensor counts = Tensor::from_vector<int64_t>({local.correct, local.count}, {2});
  group.allreduce(counts, ReduceOp::Sum)->wait();
  const double loss_sum = sum_over_ranks(group, local.loss_sum);
  return {loss_sum, counts.data<int64_t>()[0], counts.data<int64_t>()[1]};
}

// --check-replicas: how many checks passed, for the log (a failed one throws).
struct ReplicaChecks {
  int64_t passed = 0;
  int64_t first_step = 0;
  int64_t last_step = 0;
};

void replica_check(ProcessGroup& group, models::Module& model, int64_t step, ReplicaChecks& checks, int64_t every) {
  const trace::Span span("replica check", "comm", "step", step);
  const uint64_t h = hash_parameters(model);
  require_same_on_all_ranks(group, {{"the parameters", h, fmt::format("hash {:016x}", h)}},
                            fmt::format("replica check after step {}: the model", step));
  if (checks.passed++ == 0) {
    checks.first_step = step;
    spdlog::info("replica check after step {}: all {} ranks hold the same parameters (hash {:016x}); checking every {} "
                 "steps",
                 step, group.size(), h, every);
  } else {
    spdlog::debug("replica check after step {}: identical (hash {:016x})", step, h);
  }
  checks.last_step = step;
}

// Why training ended, in one line: the epochs or --max-steps, whichever came first.
void log_end_of_training(const TrainOptions& o, const TrainResult& result) {
  const int64_t steps = result.end.total_steps;
  if (o.max_steps && steps >= *o.max_steps) {
    spdlog::info("training ended at step {}: --max-steps {} reached in epoch {} of --epochs {}", steps, *o.max_steps,
                 result.end.epoch, o.epochs);
  } else if (o.max_steps) {
    spdlog::info("training ended after --epochs {} at step {}, before --max-steps {} (raise --epochs to train longer)",
                 o.epochs, steps, *o.max_steps);
  } else {
    spdlog::info("training ended after --epochs {} ({} steps)", o.epochs, steps);
  }
}

// Note [Images left out of a batch] in data/dataloader.cpp: this rank's count, once, at the end.
void report_images_left_out(const TrainingRun& run) {
  for (const auto& [split, loader] : {std::pair{"training", run.train.loader}, {"evaluation", run.test_loader}}) {
    if (!loader) continue;
    const auto [count, first] = loader->images_left_out();
    if (count == 0) continue;
    spdlog::warn("--skip-bad-images: {} {} image(s) of rank {} did not decode and were left out of their batches, "
                 "the first: {}",
                 count, split, run.env().rank, first);
  }
}

// --max-steps 0: the initial weights are evaluated, nothing is trained.
void evaluate_initial_weights(TrainingRun& run) {
  spdlog::info("--max-steps 0: no training step");
  if (!run.test_loader) return;
  EvalResult r = evaluate(*run.model, *run.test_loader, run.compute());
  if (run.control() != nullptr) r = allreduce_eval(*run.control(), r);
  spdlog::info("initial weights: test loss {:.4f}, test acc {:.3f}", r.mean_loss(), r.accuracy());
  run.metrics.write(initial_eval_event(r));
}

// What the loop calls out for in a data-parallel run: epoch and evaluation sums over
// the ranks, replica checks, buffers from rank 0, the reducer's and the exchange's metrics.
void add_data_parallel_hooks(const TrainOptions& o, TrainingRun& run, TrainLoopHooks& hooks, ReplicaChecks& checks) {
  ProcessGroup& control = *run.control();
  models::Module& model = *run.model;
  if (o.check_replicas > 0) {
    hooks.after_step = [&control, &model, &checks, every = o.check_replicas](int64_t step) {
      if (step % every == 0) replica_check(control, model, step, checks, every);
    };
  }
  hooks.combine_epoch = [&control](EpochSummary& s) {
    const EvalResult sum = allreduce_eval(control, {s.loss_sum, s.correct, s.images});
    s.loss_sum = sum.loss_sum;
    s.correct = sum.correct;
    s.images = sum.count;
  };
  hooks.combine_eval = [&control](const EvalResult& local) { return allreduce_eval(control, local); };
  if (run.train.global_batch_sampler) {
    hooks.world_samples = [&sampler = *run.train.global_batch_sampler](int64_t batch) { return sampler.step_size(batch); };
  }
  if (!o.sync_bn && !model.buffers().empty() && run.groups.gradients->size() > 1) {
    // Note [Buffers follow rank 0] (loop/train_loop.cpp); the model's device tensors travel
    // on the gradient group, as at start-up. A group of one has nothing to follow.
    hooks.sync_buffers = [gradients = run.groups.gradients, &model] { broadcast_module_buffers(*gradients, model); };
  }
  hooks.extend_metrics = [reducer = run.reducer, &exchange = *run.exchange, &model,
                          sync_bn = o.sync_bn](nlohmann::json& event) {
    add_data_parallel_fields(event, *reducer, exchange,
                             sync_bn ? models::sync_batchnorm_wait_seconds(model) : -1.0);
  };
}

// --balance: every step is timed, and after it the split of later steps may move; the shares in
// force go into every step and epoch event.
void add_balance_hooks(BatchResplitter& balance, TrainLoopConfig& config) {
  config.time_compute = true;
  config.hooks.plan_batches = [&balance](int64_t step, int64_t batches_taken) {
    balance.after_step(step, batches_taken);
  };
  config.hooks.extend_metrics = [&balance, previous = std::move(config.hooks.extend_metrics)](nlohmann::json& event) {
    if (previous) previous(event);
    balance.add_fields(event);
  };
}

// What the stop signal's acknowledgement reads on the signal thread; static, since that
// thread may outlive the run.
std::atomic<int64_t> g_steps_done{0};
std::atomic<bool> g_checkpointing{false};

// Says at once that a stop signal was received (the loop stops at a step boundary, where
// the ranks agree on the step: Note [Agreeing to stop]). Every rank that receives one
// says so, at warning level like the stop's own report, so --log-level warn shows it.
// The step count is read while a step may be running: the stop comes after the next
// step, or the one after when this rank's vote for the running one was already cast.
void acknowledge_stop(int sig) {
  const int64_t done = g_steps_done.load();
  spdlog::warn("received {} with {} steps done: stopping after step {} or {}, then {}", stop_signal_name(sig), done,
               done + 1, done + 2,
               g_checkpointing.load() ? "a checkpoint follows" : "exiting without a checkpoint (no --checkpoint-dir)");
}

// "resnet18, 2 ranks x batch 256, lr 0.1": what d2l's charts say of a run.
std::string run_title(const TrainOptions& o, const TrainingRun& run) {
  const int world = run.env().world_size;
  const std::string batch = o.global_batch_size ? fmt::format("global batch {}", *o.global_batch_size)
                                                : fmt::format("batch {}", o.batch_size);
  return fmt::format("{}, {} rank{} x {}, lr {}", o.model, world, world == 1 ? "" : "s", batch, o.lr);
}

// --plot: rank 0 redraws the curves after every epoch this run trains. A chart that
// cannot be written is a warning, once, and the run goes on without it: the picture
// must not cost the training (the other ranks would wait for rank 0 in vain).
void add_plot_hook(const TrainOptions& o, const TrainingRun& run, TrainLoopHooks& hooks) {
  if (o.plot.empty() || !run.lead()) return;
  auto points = std::make_shared<std::vector<plot::EpochPoint>>();
  auto broken = std::make_shared<bool>(false);
  hooks.after_epoch = [points, broken, title = run_title(o, run), path = o.plot](const EpochSummary& s) {
    if (*broken) return;
    std::optional<double> test;
    if (s.test) test = s.test->accuracy();
    points->push_back({static_cast<double>(s.epoch), s.train_loss, s.train_acc, test});
    try {
      plot::write_chart(plot::training_curves(title, *points), path);
    } catch (const Error& e) {
      *broken = true;
      spdlog::warn("--plot: {}; training goes on without the chart", e.what());
    }
  };
}

TrainResult train(const TrainOptions& o, TrainingRun& run, ReplicaChecks& checks) {
  Progress progress(Progress::mode_for(run.env().rank, spdlog::default_logger_raw()->should_log(spdlog::level::info)),
                    o.progress_every);
  TrainLoopConfig config;
  config.progress = &progress;
  config.steps_done = &g_steps_done;
  config.epochs = o.epochs;
  config.max_steps = o.max_steps;
  config.log_every = o.log_every;
  config.devices = all_rank_devices(run.control(), run.plan.device);
  config.device = run.compute();
  config.grad_accum = o.grad_accum;
  config.lr_schedule = run.schedule.get();
  if (run.resumed) config.start = *run.resumed;
  config.checkpoint_every = o.checkpoint_every;
  config.rank = run.env().rank;
  config.world_size = run.env().world_size;
  config.items_per_step = items_per_step(o, run.env().world_size);
  config.start_holds_rest_only = run.resumed_rest_only;
  config.trace_steps = {o.trace_first_step, o.trace_last_step};
  config.fresh_gradients = run.plan.speedups.fresh_grads;
  config.cuda_graphs = o.cuda_graphs;
  std::optional<LossScaler> scaler;
  if (uses_loss_scaler(o)) {
    LossScalerOptions scaling;
    scaling.initial_scale = o.initial_loss_scale;
    scaling.growth_interval = o.loss_scale_growth_interval;
    scaler.emplace(scaling);
    config.loss_scaler = &*scaler;
  }
  config.hooks.stop_vote = [rank = run.env().rank] { return encode_stop_vote(pending_stop_signal(), rank); };
  if (Checkpointer* checkpointer = run.checkpointer.get()) {
    config.hooks.checkpoint = [checkpointer](const TrainPosition& p, CheckpointReason reason) {
      checkpointer->save(p, reason);
    };
  }
  if (run.groups) add_data_parallel_hooks(o, run, config.hooks, checks);
  const std::unique_ptr<BatchResplitter> balance = start_balance(o, run);
  if (balance) add_balance_hooks(*balance, config);
  add_plot_hook(o, run, config.hooks);
  TrainLoop loop(*run.model, *run.optimizer, *run.sync, *run.exchange, *run.train.loader, run.test_loader.get(),
                 run.metrics, config);
  const TrainResult result = loop.run();
  if (run.exchange->rank_waits().steps > 0) spdlog::info("{}", describe_rank_waits(run.exchange->rank_waits()));
  if (balance) spdlog::info("{}", balance->summary());
  return result;
}

// The end of a run the ranks agreed to stop (Note [Stopping on a signal]): the same
// message on every rank, the record for the launcher, the exit status that says
// "stopped, resumable".
int finish_stopped_run(const TrainingRun& run, const TrainResult& result) {
  const StopVote vote = decode_stop_vote(result.stop_vote);
  const std::string signal = stop_signal_name(vote.signal);
  const std::string checkpoint = run.checkpointer ? run.checkpointer->path() : std::string();
  const std::string where =
      checkpoint.empty() ? "no checkpoint written (no --checkpoint-dir), so the run cannot be resumed"
                         : fmt::format("checkpoint written to {}", checkpoint);
  ProcessGroup* control = run.control();
  const std::string message =
      fmt::format("{}received {}: stopped after step {} (epoch {}), {}",
                  control != nullptr ? fmt::format("rank {} ", vote.rank) : std::string(), signal,
                  result.end.total_steps, result.end.epoch, where);
  if (run.lead()) spdlog::warn("{}", message);
  write_stop_record({run.env().rank, message, signal, vote.rank, result.end.epoch, result.end.total_steps, checkpoint});
  if (control != nullptr) control->barrier()->wait();
  return kStoppedExitCode;
}

void report_memory(const TrainingRun& run) {
  const AllocatorStats memory = host_allocator_stats();
  spdlog::info("tensor memory: peak {:.1f} MiB in use, {:.1f} MiB held from the system ({} system allocations)",
               static_cast<double>(memory.peak_in_use_bytes) / (1 << 20),
               static_cast<double>(memory.peak_reserved_bytes) / (1 << 20), memory.system_allocs);
  if (const Device device = run.compute(); device.is_cuda()) {
    const BlockAllocatorStats gpu = cuda_memory_stats(device.index);
    spdlog::info("{} memory: {:.1f} MiB in use, {:.1f} MiB reserved from the device ({} allocations from it)",
                 device.str(), static_cast<double>(gpu.in_use_bytes) / (1 << 20),
                 static_cast<double>(gpu.reserved_bytes) / (1 << 20), gpu.backend_allocs);
  }
}

// --save-final and --save-onnx: rank 0 writes; every rank learns how that went instead of
// waiting for it in the final barrier until the timeout.
void save_final_weights(const TrainOptions& o, const TrainingRun& run, int64_t steps) {
  if (o.save_final.empty() && o.save_onnx.empty()) return;
  std::exception_ptr failure;
  if (run.lead()) {
    try {
      if (!o.save_final.empty()) {
        SafetensorsMetadata metadata = {{kWeightsModelKey, o.model},
                                        {"mtrain.dataset", o.dataset},
                                        {"mtrain.steps", std::to_string(steps)},
                                        {"mtrain.seed", std::to_string(o.seed)},
                                        {"mtrain.init", o.init_from.empty() ? o.init.text : "file"}};
        // An image folder's class names, by label, as a JSON list: what each output means.
        const auto& classes = run.train_set->class_names();
        if (!classes.empty()) metadata["mtrain.classes"] = nlohmann::json(classes).dump();
        save_model_weights_or_keep(o.save_final, *run.model, metadata);
        spdlog::info("saved final weights ({} steps) to {}", steps, o.save_final);
      }
      if (!o.save_onnx.empty()) {
        replace_file(o.save_onnx, models::onnx::with_initializers(o.model, on_host(model_state(*run.model))));
        spdlog::info("saved the trained graph ({} steps) to {}", steps, o.save_onnx);
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  share_outcome(run.control(), run.env().rank, failure);
}

// The gradient group's last operations were awaited on the GPU only (Note [Reducer on a
// GPU]); a host-side barrier there surfaces any failure among them before exit. Nobody
// exits while a peer still needs it.
void leave_groups(const TrainingRun& run) {
  const TrainingGroups& g = run.groups;
  if (g.gradients && g.gradients != g.control) g.gradients->barrier()->wait();
  if (g.control) g.control->barrier()->wait();
}

}  // namespace

TrainChoices train_choices() { return {models::model_names(), data::known_datasets()}; }

int run_train_command(const TrainOptions& o) {
  // First, so that a stop signal during set-up stops the worker cleanly rather than
  // killing it (Note [Stopping on a signal]).
  install_stop_signal_handlers();
  WorkerEnvironment env = discover_environment();
  configure_logging(o.log_level.value, env);
  StartupStop startup(env.rank);
  // Before set-up, which may disarm the start-up exit early (under MPI).
  const bool trains = !(o.max_steps && *o.max_steps == 0);
  g_checkpointing.store(!o.checkpoint_dir.empty());
  ScopedStopAcknowledgement acknowledgement(trains ? acknowledge_stop : nullptr);
  TrainingRun run = set_up_run(o, std::move(env), startup);
  g_steps_done.store(run.resumed ? run.resumed->total_steps : 0);
  startup.disarm();  // from here a stop signal stops the run after a step, with a checkpoint

  int64_t steps = run.resumed ? run.resumed->total_steps : 0;
  if (o.max_steps && *o.max_steps == 0) {
    if (!o.trace_dir.empty())
      spdlog::warn("--trace {}: --max-steps 0 trains no step, so no timeline is written", o.trace_dir);
    evaluate_initial_weights(run);
  } else {
    ReplicaChecks checks;
    RunTrace trace(o, run);
    const TrainResult result = [&] {
      try {
        return train(o, run, checks);
      } catch (...) {
        trace.write_after_failure(run);
        throw;
      }
    }();
    acknowledgement.clear();  // a signal from here on is "after the last step"
    trace.finish(run);
    steps = result.end.total_steps;
    if (result.stop_vote != 0) return finish_stopped_run(run, result);
    log_end_of_training(o, result);
    if (run.control() && o.check_replicas > 0) {
      if (steps % o.check_replicas != 0) replica_check(*run.control(), *run.model, steps, checks, o.check_replicas);
      if (checks.passed > 0) {
        spdlog::info("replica checks: {} after steps {}..{}, every rank held the same parameters each time",
                     checks.passed, checks.first_step, checks.last_step);
      }
    } else if (o.check_replicas > 0) {
      spdlog::info("--check-replicas: nothing to check in a world of one");
    }
  }
  if (const int sig = pending_stop_signal(); sig != 0) {
    spdlog::warn("received {} after the last step; the run finished anyway", stop_signal_name(sig));
  }
  report_images_left_out(run);
  report_memory(run);
  save_final_weights(o, run, steps);
  leave_groups(run);
  return 0;
}

}  // namespace mtrain
