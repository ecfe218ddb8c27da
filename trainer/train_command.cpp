#include "trainer/train_command.h"

#include <spdlog/spdlog.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>

#include "trainer/setup/worker_store.h"
#include "collectives/process_group.h"
#include "core/error.h"
#include "data/data_source.h"
#include "data/dataloader.h"
#include "data/distributed_sampler.h"
#include "data/sampler.h"
#include "models/init.h"
#include "models/optim.h"
#include "models/mixed_precision.h"
#include "models/sync_batchnorm.h"
#include "models/zoo.h"
#include "tensor/cuda_memory.h"
#include "tensor/cuda_runtime.h"
#include "tensor/ops.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/checkpoint/checkpointer.h"
#include "trainer/setup/device.h"
#include "trainer/setup/environment.h"
#include "trainer/loop/evaluate.h"
#include "trainer/ddp/gradient_sync.h"
#include "trainer/loop/lr_schedule.h"
#include "trainer/loop/metrics.h"
#include "trainer/ddp/rank_consensus.h"
#include "trainer/ddp/reducer.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/stopping/error_file.h"
#include "trainer/stopping/stop_signals.h"
#include "trainer/loop/train_loop.h"
#include "trainer/checkpoint/checkpoint_file.h"
#include "trainer/ddp/training_groups.h"

namespace mtrain {

namespace {

// Batch assembly (uint8 -> float through a table) is far cheaper than a training step,
// so one worker keeps ahead of the loop without taking a core from the kernels.
constexpr int kLoaderWorkers = 1;
constexpr int kPrefetchDepth = 2;

// Only rank 0 speaks at info level; the others report warnings and errors, prefixed
// with their rank so interleaved output stays attributable.
void configure_logging(const std::string& level, const WorkerEnvironment& env) {
  if (env.rank == 0) {
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
    spdlog::set_level(spdlog::level::from_str(level));
  } else {
    spdlog::set_pattern(fmt::format("[%Y-%m-%d %H:%M:%S.%e] [%l] [rank {}] %v", env.rank));
    spdlog::set_level(std::max(spdlog::level::from_str(level), spdlog::level::warn));
  }
}

// An output file must be writable before training starts, not after an hour of it: its
// directory exists and takes new files (the writes go through a temporary file there and
// a rename), and the path is a regular file or not there yet.
void check_output_file(const char* flag, const std::string& path) {
  if (path.empty()) return;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? "." : parent.string();
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw InvalidArgument(fmt::format("{} {}: directory {} does not exist", flag, path, dir));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw InvalidArgument(fmt::format("{} {}: cannot create files in directory {}: {}", flag, path, dir,
                                      std::strerror(errno)));
  }
  // A directory cannot be written, a FIFO would block the open, and a device would be
  // replaced by the save's rename.
  if (const auto kind = non_regular_file_kind(path)) {
    throw InvalidArgument(fmt::format("{} {}: expected a regular file or a new name, found {}", flag, path, *kind));
  }
}

// One line saying where training runs and why (ARCHITECTURE.md: "No GPU -> CPU, said
// once in the log").
void log_device(const TrainingDevice& device, const ThreadChoice& threads) {
  spdlog::info("{}; {} intra-op thread{} for host kernels ({})", device.log_line, threads.threads,
               threads.threads == 1 ? "" : "s", threads.reason);
  if (!device.binding.warning.empty()) spdlog::warn("{}", device.binding.warning);
  // Bound to fewer CPUs (taskset, mtrain-launch --cpu_bind, a cpuset) than threads: they
  // would take turns on the same cores, every kernel waiting for its slowest thread.
  if (const int cpus = usable_cpu_count(); threads.threads > cpus) {
    spdlog::warn("{} intra-op threads but this process may run on {} CPU{} only (its affinity mask): the threads "
                 "will time-share; use --threads {}",
                 threads.threads, cpus, cpus == 1 ? "" : "s", cpus);
  }
}

void log_environment(const WorkerEnvironment& env) {
  if (!env.distributed()) {
    spdlog::info("world: one process (no launcher variables found)");
    return;
  }
  spdlog::info("world: {} ranks from {} variables, this is rank {} (local rank {} of {}, node {})", env.world_size,
               env.source, env.rank, env.local_rank, env.local_world_size, env.node_rank);
}

// `pinned`: batches assembled in pinned host memory, so that their copies to a GPU
// overlap the step before them (Note [Batches to the device] in device_batches.h).
std::shared_ptr<data::DataLoader> make_loader(std::shared_ptr<const data::Dataset> dataset,
                                              std::shared_ptr<data::Sampler> sampler, int64_t batch_size,
                                              bool pinned, std::vector<int64_t> batch_sizes = {}) {
  data::DataLoaderOptions o;
  o.pin_memory = pinned;
  o.batch_size = batch_size;
  o.batch_sizes = std::move(batch_sizes);
  o.drop_last = false;
  o.num_workers = kLoaderWorkers;
  o.prefetch_depth = kPrefetchDepth;
  return std::make_shared<data::DataLoader>(std::move(dataset), std::move(sampler), o);
}

// --loss-scale auto: dynamic exactly when float16 needs it (Note [Dynamic loss scaling]).
bool uses_loss_scaler(const TrainOptions& o) {
  return o.loss_scale == "dynamic" || (o.loss_scale == "auto" && o.amp == "fp16");
}

// The compute type --amp asks for, once it is known to exist on `device`.
DType amp_compute_dtype(const TrainOptions& o, const Device& device) {
  if (o.amp == "off") return DType::Float32;
  const DType t = o.amp == "bf16" ? DType::BFloat16 : DType::Float16;
  if (!ops::compute_dtype_supported(t, device)) {
    throw InvalidArgument(fmt::format(
        "--amp {}: {} has no {} convolutions ({}); run without --amp", o.amp, device.str(), dtype_name(t),
        device.is_cuda() ? (t == DType::BFloat16 ? "bfloat16 needs compute capability 8.0 or newer"
                                                 : "float16 needs compute capability 7.0 or newer")
                         : (t == DType::BFloat16 ? "oneDNN needs AVX512_BF16, or at least AVX-512, for them"
                                                 : "oneDNN needs AVX512_FP16 for them")));
  }
  return t;
}

SafetensorsMetadata weights_metadata(const TrainOptions& o, int64_t steps) {
  return {{kWeightsModelKey, o.model}, {"mtrain.dataset", o.dataset}, {"mtrain.steps", std::to_string(steps)},
          {"mtrain.seed", std::to_string(o.seed)}, {"mtrain.init", o.init_from.empty() ? o.init : "file"}};
}

// Every flag that changes what is trained or how the ranks cooperate; paths and
// logging flags may differ per rank. Rank 0 is the reference (Note [Consensus by
// hashes] in rank_consensus.h).
// FNV-1a of the training set's labels and pixels, as 16 hex digits: the same size from
// other files (another dataset directory on one node, a different copy after a resume)
// changes it. About 20 ms for Fashion-MNIST's 47 MB.
std::string dataset_fingerprint(const data::Dataset& d) {
  uint64_t h = fnv1a(d.labels().data(), d.labels().size() * sizeof(int64_t));
  h = fnv1a(d.pixels().data(), d.pixels().size(), h);
  return fmt::format("{:016x}", h);
}

// `fingerprint`: dataset_fingerprint of the training set.
std::vector<NamedHash> training_configuration(const TrainOptions& o, int64_t train_size, const std::string& fingerprint,
                                              const Device& device) {
  std::vector<NamedHash> items;
  const auto add = [&](const char* name, const std::string& value) {
    items.push_back({name, fnv1a(value), value});
  };
  add("--model", o.model);
  add("--dataset", o.dataset);
  add("training set size", std::to_string(train_size));
  add("training set fingerprint", fingerprint);
  add("--epochs", std::to_string(o.epochs));
  add("--max-steps", o.max_steps ? std::to_string(*o.max_steps) : "unset");
  add("--batch-size", std::to_string(o.batch_size));
  add("--global-batch-size", o.global_batch_size ? std::to_string(*o.global_batch_size) : "unset");
  add("--lr", fmt::format("{}", o.lr));
  add("--momentum", fmt::format("{}", o.momentum));
  add("--weight-decay", fmt::format("{}", o.weight_decay));
  add("--nesterov", o.nesterov ? "on" : "off");
  add("--seed", std::to_string(o.seed));
  add("--init", o.init_from.empty() ? o.init : "file");
  add("--no-shuffle", o.shuffle ? "off" : "on");
  add("--no-eval", o.eval ? "off" : "on");
  add("--backend", o.backend);
  // Replicas on different kinds of device would round differently and drift apart.
  add("the training device (--device)", device.is_cuda() ? "cuda" : "cpu");
  add("--bucket-cap-mb", fmt::format("{}", o.bucket_cap_mb));
  add("--grad-compression", o.grad_compression);
  // A rank scaling its loss (or rounding its operands) differently would send gradients
  // of another size into the average.
  add("--amp", o.amp);
  add("--loss-scale", uses_loss_scaler(o) ? "dynamic" : "none");
  add("--initial-loss-scale", fmt::format("{}", o.initial_loss_scale));
  add("--loss-scale-growth-interval", std::to_string(o.loss_scale_growth_interval));
  add("--grad-accum", std::to_string(o.grad_accum));
  add("--check-replicas", std::to_string(o.check_replicas));
  add("--sync-bn", o.sync_bn ? "on" : "off");
  add("--timeout", fmt::format("{}", o.timeout_seconds));
  add("--lr-scaling", o.lr_scaling);
  add("--warmup-epochs", fmt::format("{}", o.warmup_epochs));
  add("--lr-schedule", o.lr_schedule);
  add("--checkpoint-every", std::to_string(o.checkpoint_every));
  add("--checkpoint-dir", o.checkpoint_dir.empty() ? "unset" : "set");
  return items;
}

// What a checkpoint must have been written under to be resumed by this run: every
// setting that changes the sequence of updates. Unlike training_configuration, the
// world size is in (each rank's shard depends on it) and the backend, bucket cap and
// timeouts are not (they change how the sums travel, not what they are). The length of
// the run (--epochs, --max-steps) only matters when the learning-rate schedule depends
// on it: with a constant rate a finished run can be extended by resuming it with a
// larger --epochs or --max-steps.
RunConfiguration resume_configuration(const TrainOptions& o, int64_t train_size, const std::string& fingerprint,
                                      int world_size) {
  RunConfiguration items = {
      {"--model", o.model},
      {"--dataset", o.dataset},
      {"training set size", std::to_string(train_size)},
      {"training set fingerprint", fingerprint},
      {"world size", std::to_string(world_size)},
      {"--batch-size", o.global_batch_size ? "unused" : std::to_string(o.batch_size)},
      {"--global-batch-size", o.global_batch_size ? std::to_string(*o.global_batch_size) : "unset"},
      {"--grad-accum", std::to_string(o.grad_accum)},
      {"--lr", fmt::format("{}", o.lr)},
      {"--momentum", fmt::format("{}", o.momentum)},
      {"--weight-decay", fmt::format("{}", o.weight_decay)},
      {"--nesterov", o.nesterov ? "on" : "off"},
      {"--seed", std::to_string(o.seed)},
      {"--no-shuffle", o.shuffle ? "off" : "on"},
      {"--sync-bn", o.sync_bn ? "on" : "off"},
      {"--lr-scaling", o.lr_scaling},
      {"--warmup-epochs", fmt::format("{}", o.warmup_epochs)},
      {"--lr-schedule", o.lr_schedule},
      {"--amp", o.amp},
      {"--loss-scale", uses_loss_scaler(o) ? "dynamic" : "none"},
      {"--grad-compression", world_size > 1 ? o.grad_compression : "none"},
  };
  // When the scale grows decides which later steps overflow and are skipped.
  if (uses_loss_scaler(o)) {
    items.emplace_back("--loss-scale-growth-interval", std::to_string(o.loss_scale_growth_interval));
  }
  if (o.lr_schedule != "constant") {
    items.emplace_back("--epochs", std::to_string(o.epochs));
    items.emplace_back("--max-steps", o.max_steps ? std::to_string(*o.max_steps) : "unset");
  }
  return items;
}

// Sums this rank's (loss_sum, correct, count) with every other rank's.
EvalResult allreduce_eval(ProcessGroup& group, const EvalResult& local) {
  Tensor counts = Tensor::from_vector<int64_t>({local.correct, local.count}, {2});
  group.allreduce(counts, ReduceOp::Sum)->wait();
  const double loss_sum = sum_over_ranks(group, local.loss_sum);
  return {loss_sum, counts.data<int64_t>()[0], counts.data<int64_t>()[1]};
}

void replica_check(ProcessGroup& group, models::Module& model, int64_t step) {
  const uint64_t h = hash_parameters(model);
  require_same_on_all_ranks(group, {{"the parameters", h, fmt::format("hash {:016x}", h)}},
                            fmt::format("replica check after step {}: the model", step));
}

// The end of a run the ranks agreed to stop (Note [Stopping on a signal]): the same
// message on every rank, the record for the launcher, the exit status that says
// "stopped, resumable".
int finish_stopped_run(const WorkerEnvironment& env, ProcessGroup* control, const TrainResult& result,
                       const std::string& checkpoint) {
  const StopVote vote = decode_stop_vote(result.stop_vote);
  const std::string signal = stop_signal_name(vote.signal);
  const std::string where =
      checkpoint.empty() ? "no checkpoint written (no --checkpoint-dir), so the run cannot be resumed"
                         : fmt::format("checkpoint written to {}", checkpoint);
  const std::string message =
      fmt::format("{}received {}: stopped after step {} (epoch {}), {}",
                  control != nullptr ? fmt::format("rank {} ", vote.rank) : std::string(), signal,
                  result.end.total_steps, result.end.epoch, where);
  if (env.rank == 0) spdlog::warn("{}", message);
  write_stop_record({env.rank, message, signal, vote.rank, result.end.epoch, result.end.total_steps, checkpoint});
  if (control != nullptr) control->barrier()->wait();
  return kStoppedExitCode;
}

// How far start-up got, for the record of a stop before the first step (Note [A stop
// signal during start-up] in stop_signals.h); read on the signal thread.
struct StartupProgress {
  std::mutex mu;
  std::string checkpoint;  // the checkpoint a rerun resumes from; empty: none
  int64_t epoch = 0;       // its position, once read
  int64_t step = 0;
};

StartupStopAction startup_stop_action(int rank, std::shared_ptr<StartupProgress> progress) {
  return [rank, progress](int sig) {
    StopRecord record;
    {
      std::lock_guard<std::mutex> lock(progress->mu);
      record.checkpoint = progress->checkpoint;
      record.epoch = progress->epoch;
      record.step = progress->step;
    }
    record.rank = rank;
    record.signal = stop_signal_name(sig);
    record.signal_rank = rank;
    record.during_startup = true;
    record.message = fmt::format(
        "received {} during start-up, before the first step: stopped at once; {}", record.signal,
        record.checkpoint.empty()
            ? std::string("no checkpoint to resume from, so running the command again starts from the beginning")
            : fmt::format("the checkpoint {} is untouched and running the same command again resumes from it",
                          record.checkpoint));
    // The record first: it is what the launcher reads, and a log line can block on a
    // full pipe.
    write_stop_record(record);
    spdlog::warn("{}", record.message);
    spdlog::default_logger()->flush();
  };
}

}  // namespace

TrainChoices train_choices() { return {models::model_names(), data::known_datasets()}; }

int run_train_command(const TrainOptions& o) {
  // First, so that a stop signal during set-up stops the worker cleanly rather than
  // killing it (Note [Stopping on a signal]).
  install_stop_signal_handlers();
  WorkerEnvironment env = discover_environment(o.backend);
  configure_logging(o.log_level, env);
  auto startup = std::make_shared<StartupProgress>();
  arm_startup_stop(startup_stop_action(env.rank, startup));
  // Start-up may also end in an error; its record must not race the start-up exit's
  // (both write the error file), so leaving this function disarms first.
  struct Disarm {
    ~Disarm() { disarm_startup_stop(); }
  } disarm_on_exit;
  // Before anything is loaded, so that --device cuda without a GPU fails at once.
  const TrainingDevice training_device = set_up_training_device(o, env);
  const Device device = training_device.compute;
  const DType amp = amp_compute_dtype(o, device);
  const std::string backend = training_device.binding.backend;
  // Whether the run needs a store depends on the backend, which "auto" only names once
  // the device is known (nccl on a GPU even under mpirun).
  if (backend != o.backend && env.distributed()) env = discover_environment(backend);
  check_output_file("--save-final", o.save_final);
  check_output_file("--metrics", o.metrics);
  const bool lead = env.rank == 0;  // logs, writes metrics and final weights
  // A run that will resume from a checkpoint continues the metrics of the run it
  // resumes instead of erasing them.
  // (A file that cannot be looked at counts as absent here; Checkpointer::resume names it.)
  std::error_code exists_error;
  const bool resuming =
      !o.checkpoint_dir.empty() && std::filesystem::exists(checkpoint_path(o.checkpoint_dir), exists_error);
  if (resuming) {
    std::lock_guard<std::mutex> lock(startup->mu);
    startup->checkpoint = checkpoint_path(o.checkpoint_dir);
  }
  MetricsWriter metrics =
      o.metrics.empty() || !lead
          ? MetricsWriter()
          : MetricsWriter(o.metrics, resuming ? MetricsWriter::Mode::kAppend : MetricsWriter::Mode::kTruncate);

  log_environment(env);
  const ThreadChoice threads = resolve_num_threads(o.threads, env);
  ops::set_num_threads(threads.threads);
  log_device(training_device, threads);
  if (amp != DType::Float32) {
    spdlog::info("--amp {}: convolutions and linear layers multiply in {}, everything else stays float32{}", o.amp,
                 dtype_name(amp), uses_loss_scaler(o) ? "; dynamic loss scaling" : "");
  }

  // Note [A stop signal during start-up]: a process that called MPI_Init must not end
  // without MPI_Finalize (mpirun would take the stop for a crash), so under MPI the
  // first stop signal waits for the first step, as every stop signal once did.
  if (backend == "mpi" || env.store_mode == StoreMode::kMpiBroadcast) disarm_startup_stop();
  // Note [Control-plane collectives] (training_groups.h): `group` carries tensors on
  // the training device, `control` host values; one object unless the backend is NCCL.
  TrainingGroups groups;
  ProcessGroupOptions pg_options;
  pg_options.timeout = Millis(static_cast<int64_t>(o.timeout_seconds * 1000.0));
  if (env.distributed()) {
    // Null for the MPI backend under an MPI starter, which bootstraps itself.
    std::shared_ptr<Store> store = open_worker_store(env);
    groups = create_training_groups(backend, store, env.rank, env.world_size, training_device.binding.device,
                                    pg_options);
  } else if (backend == "nccl") {
    groups = create_single_rank_nccl_groups(device, pg_options);
  }
  const std::shared_ptr<ProcessGroup> group = groups.gradients;
  ProcessGroup* const control = groups.control.get();
  if (group) {
    spdlog::info("process group: {} backend, {} ranks, collective timeout {} s{}", group->backend_name(),
                 group->size(), o.timeout_seconds,
                 groups.control != groups.gradients
                     ? fmt::format("; host values on a separate {} group", groups.control->backend_name())
                     : std::string());
  }

  const data::DataSource source = data::resolve_data_dir(o.dataset, o.data_dir);
  spdlog::info("data: {}", source.description);
  data::SyntheticOptions synthetic;
  synthetic.seed = o.seed;
  data::DatasetSplits splits = data::load_splits(source, synthetic);
  auto train_set = std::make_shared<const data::Dataset>(std::move(splits.train));
  auto test_set = std::make_shared<const data::Dataset>(std::move(splits.test));
  spdlog::info("train set: {}", train_set->describe());
  spdlog::info("test set: {}", test_set->describe());
  // Found now rather than at the first evaluation, an epoch later.
  if (const data::ImageShape a = train_set->shape(), b = test_set->shape(); !(a == b)) {
    throw IoError(fmt::format("{}: the training images are {}x{}x{} but the test images {}x{}x{}; both "
                              "splits must come from one dataset",
                              source.description, a.channels, a.height, a.width, b.channels, b.height, b.width));
  }
  // With --no-eval nothing reads the test images again (Fashion-MNIST's: 7.5 MiB).
  if (!o.eval) test_set.reset();
  // Hashed once, for the checks below that use it.
  const std::string fingerprint =
      control || !o.checkpoint_dir.empty() ? dataset_fingerprint(*train_set) : std::string();
  if (control) {
    require_same_on_all_ranks(*control, training_configuration(o, train_set->size(), fingerprint, device),
                              "the training configuration");
  }
  // Note [SyncBatchNorm's own group] (training_groups.h): opened right after the
  // configuration check, which proved that every rank runs --sync-bn, and before
  // anything one rank alone could fail at (a weights file) while the others waited in
  // this rendezvous.
  const std::shared_ptr<ProcessGroup> batch_stats_group =
      o.sync_bn && group ? create_batch_stats_group(groups) : nullptr;

  models::InitOptions init;
  init.scheme = models::parse_init_scheme(o.init);
  init.seed = o.seed;
  std::unique_ptr<models::Module> model =
      models::build_model(o.model, static_cast<int>(train_set->channels()),
                          static_cast<int>(train_set->num_classes()), init);
  if (!o.init_from.empty()) {
    load_model_weights(o.init_from, *model);
    spdlog::info("model {}: weights from {}", o.model, o.init_from);
  } else {
    spdlog::info("model {}: {} initialisation, seed {}", o.model, o.init, o.seed);
  }
  if (o.sync_bn) {
    if (group) {
      const int converted = models::convert_sync_batchnorm(*model, batch_stats_group);
      spdlog::info("--sync-bn: {} BatchNorm2d layers now synchronise their statistics over {} ranks", converted,
                   group->size());
    } else {
      spdlog::info("--sync-bn: a world of one, so BatchNorm2d already sees the whole batch; nothing converted");
    }
  }
  if (amp != DType::Float32) models::set_compute_dtype(*model, amp);
  // Nothing uses the gradient of the images: the first layer skips computing it.
  model->set_input_grad_needed(false);
  // Built and initialised on the host (the seeded generators fill host tensors, so
  // every device starts from the same weights), moved before anything holds views of
  // its gradients (the reducer's buckets) or state derived from it (momentum).
  model->to(device);
  if (group) {
    // Every replica starts from rank 0's weights and buffers, whatever its seed or file.
    broadcast_module_state(*group, *model);
  }
  spdlog::info("model {}: {} parameters in {} tensors, {} buffers", o.model, model->num_parameter_elements(),
               model->parameters().size(), model->buffers().size());

  const int world = env.world_size;
  const double world_scale = o.lr_scaling == "linear" && !o.global_batch_size ? static_cast<double>(world) : 1.0;
  if (o.warmup_epochs > 0 && world_scale == 1.0) {
    spdlog::warn("--warmup-epochs {}: the warm-up ramps from --lr to the scaled rate, which is --lr itself here "
                 "(--lr-scaling {}, {} rank{}), so the rate stays at {} until the schedule starts",
                 o.warmup_epochs, o.lr_scaling, world, world == 1 ? "" : "s", o.lr);
  }
  models::SgdOptions sgd;
  sgd.lr = static_cast<float>(o.lr * world_scale);
  sgd.momentum = static_cast<float>(o.momentum);
  sgd.weight_decay = static_cast<float>(o.weight_decay);
  sgd.nesterov = o.nesterov;
  models::Sgd optimizer(*model, sgd);
  spdlog::info("optimizer: SGD lr {} momentum {} weight decay {}{}", sgd.lr, o.momentum, o.weight_decay,
               o.nesterov ? " nesterov" : "");

  std::unique_ptr<Checkpointer> checkpointer;
  std::optional<TrainPosition> resumed;
  if (!o.checkpoint_dir.empty()) {
    checkpointer = std::make_unique<Checkpointer>(o.checkpoint_dir, group.get(), env.rank, *model, optimizer,
                                                  resume_configuration(o, train_set->size(), fingerprint, env.world_size),
                                                  control);
    resumed = checkpointer->resume();
    if (resumed) {
      {
        std::lock_guard<std::mutex> lock(startup->mu);
        startup->epoch = resumed->epoch;
        startup->step = resumed->total_steps;
      }
      spdlog::info("resuming from {}: epoch {}, {} steps done in it, {} in total{}", checkpointer->path(),
                   resumed->epoch, resumed->steps_in_epoch, resumed->total_steps,
                   resumed->epoch_finished ? " (epoch finished)" : "");
    } else {
      spdlog::info("checkpoints: none in {} yet; this run starts from the beginning and writes {}",
                   o.checkpoint_dir, checkpointer->path());
    }
  }

  // The distributed samplers in a world of one are the plain shuffled (or sequential)
  // order, so one rank with batch N*B reads exactly what N ranks with batch B read.
  std::shared_ptr<data::DataLoader> train_loader;
  if (o.global_batch_size && o.sync_bn && group) {
    // A rank with an empty share skips forward (Note [Gradients are views into the buckets]), but
    // SyncBatchNorm's forward is a collective every rank must join.
    const int64_t g = *o.global_batch_size;
    for (const int64_t batch : {g, train_set->size() % g}) {
      if (batch == 0) continue;
      const auto shares = data::split_global_batch(batch, world);
      if (std::find(shares.begin(), shares.end(), 0) != shares.end()) {
        throw InvalidArgument(fmt::format(
            "--sync-bn with --global-batch-size {}: a global batch of {} images leaves some of the {} ranks with "
            "none, and SyncBatchNorm needs every rank in every forward; choose a global batch size whose split "
            "(and that of the epoch's last batch, {} images) gives every rank at least one image",
            g, batch, world, train_set->size() % g));
      }
    }
  }
  if (o.global_batch_size) {
    auto sampler = std::make_shared<data::GlobalBatchShardSampler>(train_set->size(), env.rank, world,
                                                                   *o.global_batch_size, o.shuffle, o.seed, false);
    train_loader = make_loader(train_set, sampler, *o.global_batch_size, device.is_cuda(), sampler->batch_sizes());
  } else {
    auto sampler = std::make_shared<data::DistributedSampler>(train_set->size(), env.rank, world, o.shuffle,
                                                              o.seed, false);
    train_loader = make_loader(train_set, sampler, o.batch_size, device.is_cuda());
  }
  std::shared_ptr<data::DataLoader> test_loader;
  if (o.eval) {
    // Per rank, the largest training share (a global batch's first chunk), not G itself.
    const int64_t eval_batch =
        o.global_batch_size ? (*o.global_batch_size + world - 1) / world : o.batch_size;
    test_loader = make_loader(test_set, std::make_shared<data::EvalShardSampler>(test_set->size(), env.rank, world),
                              eval_batch, device.is_cuda());
  }
  spdlog::info("train loader: {}", train_loader->describe());

  std::unique_ptr<GradientSynchronizer> sync;
  Reducer* reducer = nullptr;
  if (group) {
    ReducerOptions ro;
    ro.bucket_cap_bytes = static_cast<size_t>(o.bucket_cap_mb * 1024.0 * 1024.0);
    ro.compression = o.grad_compression == "bf16"   ? DType::BFloat16
                     : o.grad_compression == "fp16" ? DType::Float16
                                                    : DType::Float32;
    ro.weight_by_sample_count = o.global_batch_size.has_value();
    auto r = std::make_unique<Reducer>(group, ro, groups.control);
    reducer = r.get();
    sync = std::move(r);
  } else {
    sync = std::make_unique<LocalGradients>();
  }
  // Note [Set-up memory]
  // ~~~~~~~~~~~~~~~~~~~~
  // Set-up leaves large blocks in the host allocator's cache: the flat buffer that
  // broadcast the model state (as large as the model) and, once the reducer has
  // re-seated the gradients into its buckets, the old gradients (as large again). A
  // cached block serves any request up to half its size (Note [Host caching
  // allocator]), so a 24 MiB bucket took the 43 MiB broadcast buffer and held 19 MiB
  // idle for the whole run, and the old gradients sat in the cache for the leftovers of
  // activations. Returning the cache to the system before and after attaching leaves
  // the buckets in blocks of their own size (ResNet-18 on 2 ranks: 19 MiB less tensor
  // memory and 24-27 MiB less resident memory per rank).
  host_allocator_release_cache();
  sync->attach(*model);
  host_allocator_release_cache();
  spdlog::info("gradients: {}", sync->describe());

  const int64_t steps_per_epoch = (train_loader->num_batches() + o.grad_accum - 1) / o.grad_accum;
  double run_epochs = static_cast<double>(o.epochs);
  if (o.max_steps && steps_per_epoch > 0) {
    run_epochs = std::min(run_epochs, static_cast<double>(*o.max_steps) / static_cast<double>(steps_per_epoch));
  }
  LrScheduleOptions lr_options;
  lr_options.base_lr = o.lr;
  lr_options.world_scale = world_scale;
  lr_options.warmup_epochs = o.warmup_epochs;
  lr_options.total_epochs = std::max(run_epochs, 1e-9);
  lr_options.kind = parse_lr_schedule(o.lr_schedule);
  const LrSchedule schedule(lr_options);
  spdlog::info("learning rate: {}", schedule.describe());

  int64_t steps = resumed ? resumed->total_steps : 0;
  // From here a stop signal stops the run after a step, with a checkpoint.
  disarm_startup_stop();
  if (o.max_steps && *o.max_steps == 0) {
    spdlog::info("--max-steps 0: no training step");
    if (test_loader) {
      EvalResult r = evaluate(*model, *test_loader, device);
      if (control) r = allreduce_eval(*control, r);
      spdlog::info("initial weights: test loss {:.4f}, test acc {:.3f}", r.mean_loss(), r.accuracy());
      metrics.write({{"event", "eval"},
                     {"epoch", 0},
                     {"step", 0},
                     {"test_loss", json_number(r.mean_loss())},
                     {"test_acc", r.accuracy()}});
    }
  } else {
    TrainLoopConfig config;
    config.epochs = o.epochs;
    config.max_steps = o.max_steps;
    config.log_every = o.log_every;
    config.devices = all_rank_devices(control, training_device);
    config.device = device;
    config.grad_accum = o.grad_accum;
    config.lr_schedule = &schedule;
    if (resumed) config.start = *resumed;
    config.checkpoint_every = o.checkpoint_every;
    const int rank = env.rank;
    config.rank = rank;
    std::optional<LossScaler> scaler;
    if (uses_loss_scaler(o)) {
      LossScalerOptions scaling;
      scaling.initial_scale = o.initial_loss_scale;
      scaling.growth_interval = o.loss_scale_growth_interval;
      scaler.emplace(scaling);
      config.loss_scaler = &*scaler;
    }
    config.hooks.stop_vote = [rank] { return encode_stop_vote(pending_stop_signal(), rank); };
    if (checkpointer) {
      config.hooks.checkpoint = [&checkpointer](const TrainPosition& p, CheckpointReason reason) {
        checkpointer->save(p, reason);
      };
    }
    if (group) {
      ProcessGroup& g = *control;
      models::Module& m = *model;
      if (o.check_replicas > 0) {
        const int64_t every = o.check_replicas;
        config.hooks.after_step = [&g, &m, every](int64_t step) {
          if (step % every == 0) replica_check(g, m, step);
        };
      }
      config.hooks.combine_epoch = [&g](EpochSummary& s) {
        const EvalResult sum = allreduce_eval(g, {s.loss_sum, s.correct, s.images});
        s.loss_sum = sum.loss_sum;
        s.correct = sum.correct;
        s.images = sum.count;
      };
      config.hooks.combine_eval = [&g](const EvalResult& local) { return allreduce_eval(g, local); };
      if (!o.sync_bn && !m.buffers().empty()) {
        // Note [Buffers follow rank 0] (train_loop.h); the model's device tensors travel
        // on the gradient group, as at start-up.
        config.hooks.sync_buffers = [gradients = group, &m] { broadcast_module_buffers(*gradients, m); };
      }
      const bool sync_bn = o.sync_bn;
      config.hooks.extend_metrics = [reducer, &m, sync_bn](nlohmann::json& event) {
        const ReducerStepStats& last = reducer->last_step();
        nlohmann::json launches = nlohmann::json::array();
        for (const auto& l : last.launches) {
          launches.push_back({{"bucket", l.bucket}, {"params_pending", l.params_pending}});
        }
        event["comm_wait_sec"] = reducer->totals().wait_seconds;
        // Not measured when the buckets are awaited on the GPU (Note [Reducer statistics]).
        event["comm_hidden_fraction"] =
            last.waited_on_device ? nlohmann::json(nullptr) : nlohmann::json(reducer->totals().hidden_fraction());
        event["bucket_launches"] = std::move(launches);
        // Note [Every rank's wait] in reducer.h; running totals like comm_wait_sec.
        const RankWaits& waits = reducer->rank_waits();
        event["rank_waits"] = last.waited_on_device
                                  ? nlohmann::json(nullptr)
                                  : nlohmann::json{{"steps", waits.steps},
                                                   {"wait_sec", waits.wait_seconds},
                                                   {"slowest_steps", waits.slowest_steps},
                                                   {"exposed_sec", waits.exposed_seconds}};
        if (sync_bn) event["syncbn_wait_sec"] = models::sync_batchnorm_wait_seconds(m);
      };
    }
    TrainLoop loop(*model, optimizer, *sync, *train_loader, test_loader.get(), metrics, config);
    const TrainResult result = loop.run();
    steps = result.end.total_steps;
    if (reducer != nullptr && reducer->rank_waits().steps > 0) {
      spdlog::info("{}", describe_rank_waits(reducer->rank_waits()));
    }
    if (result.stop_vote != 0) {
      return finish_stopped_run(env, control, result, checkpointer ? checkpointer->path() : std::string());
    }
    if (control && o.check_replicas > 0 && steps % o.check_replicas != 0) replica_check(*control, *model, steps);
  }
  if (const int sig = pending_stop_signal(); sig != 0) {
    spdlog::warn("received {} after the last step; the run finished anyway", stop_signal_name(sig));
  }
  const AllocatorStats memory = host_allocator_stats();
  spdlog::info("tensor memory: peak {:.1f} MiB in use, {:.1f} MiB held from the system ({} system allocations)",
               static_cast<double>(memory.peak_in_use_bytes) / (1 << 20),
               static_cast<double>(memory.peak_reserved_bytes) / (1 << 20), memory.system_allocs);
  if (device.is_cuda()) {
    const BlockAllocatorStats gpu = cuda_memory_stats(device.index);
    spdlog::info("{} memory: {:.1f} MiB in use, {:.1f} MiB reserved from the device ({} allocations from it)",
                 device.str(), static_cast<double>(gpu.in_use_bytes) / (1 << 20),
                 static_cast<double>(gpu.reserved_bytes) / (1 << 20), gpu.backend_allocs);
  }

  if (!o.save_final.empty()) {
    // Rank 0 writes; every rank learns how that went instead of waiting for it in the
    // barrier below until the timeout.
    std::exception_ptr failure;
    if (lead) {
      try {
        save_model_weights(o.save_final, *model, weights_metadata(o, steps));
        spdlog::info("saved final weights ({} steps) to {}", steps, o.save_final);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    share_outcome(control, env.rank, failure);
  }
  // The gradient group's last operations were awaited on the GPU only (Note [Reducer on
  // a GPU]); a host-side barrier there surfaces any failure among them before exit.
  if (group && group != groups.control) group->barrier()->wait();
  if (control) control->barrier()->wait();  // nobody exits while a peer still needs it
  return 0;
}

}  // namespace mtrain
