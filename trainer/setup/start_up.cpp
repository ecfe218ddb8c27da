#include "trainer/setup/start_up.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "core/error.h"
#include "core/files.h"
#include "data/data_source.h"
#include "data/distributed_sampler.h"
#include "data/shard_sampler.h"
#include "data/sampler.h"
#include "trainer/plot/chart.h"
#include "models/init.h"
#include "models/rewrites.h"
#include "models/mixed_precision.h"
#include "models/sync_batchnorm.h"
#include "models/zoo.h"
#include "tensor/ops.h"
#include "trainer/checkpoint/checkpoint_file.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/ddp/rank_consensus.h"
#include "trainer/setup/agreement.h"
#include "trainer/setup/worker_store.h"

namespace mtrain {

namespace {

// Batch assembly from memory (uint8 -> float through a table) is far cheaper than a training
// step, so one worker keeps ahead of the loop without taking a core from the kernels. A
// streamed set decodes every image every epoch: several workers, each a batch ahead.
constexpr int kLoaderWorkers = 1;
constexpr int kStreamedLoaderWorkers = 4;
constexpr int kPrefetchDepth = 2;

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

// `pinned`: batches assembled in pinned host memory, so that their copies to a GPU
// overlap the step before them (Note [Batches to the device] in loop/device_batches.cpp).
std::shared_ptr<data::DataLoader> make_loader(const TrainOptions& flags, std::shared_ptr<const data::Dataset> dataset,
                                              std::shared_ptr<data::Sampler> sampler, int64_t batch_size,
                                              bool pinned, const data::ChannelStats& normalization,
                                              const data::Augmentation& augment = {}) {
  data::DataLoaderOptions o;
  o.skip_bad_images = flags.skip_bad_images;
  o.num_workers = static_cast<int>(flags.loader_workers.value_or(dataset->in_memory() ? kLoaderWorkers
                                                                                       : kStreamedLoaderWorkers));
  o.prefetch_depth = std::max(kPrefetchDepth, o.num_workers + 1);
  o.mean = normalization.mean;
  o.std = normalization.std;
  o.augment = augment;
  o.pin_memory = pinned;
  o.batch_size = batch_size;
  o.drop_last = false;
  return std::make_shared<data::DataLoader>(std::move(dataset), std::move(sampler), o);
}

// ---- the phases, in the order set_up_run runs them ----------------------------------

// Output files are checked before any work; a run that will resume from a checkpoint
// continues the metrics of the run it resumes instead of erasing them. (A checkpoint
// that cannot be looked at counts as absent here; Checkpointer::resume names it.)
void open_outputs(const TrainOptions& o, TrainingRun& run, StartupStop& startup) {
  check_output_file("--save-final", o.save_final);
  check_output_file("--save-onnx", o.save_onnx);
  check_output_file("--metrics", o.metrics);
  check_output_file("--plot", o.plot);
  if (!o.plot.empty()) plot::check_chart_path(o.plot, "--plot");
  std::error_code exists_error;
  const bool resuming =
      !o.checkpoint_dir.empty() && std::filesystem::exists(checkpoint_path(o.checkpoint_dir), exists_error);
  if (resuming) startup.resumes_from(checkpoint_path(o.checkpoint_dir));
  if (!o.metrics.empty() && run.lead()) {
    run.metrics = MetricsWriter(o.metrics, resuming ? MetricsWriter::Mode::kAppend : MetricsWriter::Mode::kTruncate);
  }
}

// The intra-op threads, and one line each for the world, the device (ARCHITECTURE.md:
// "No GPU -> CPU, said once in the log"), the speed switches and --amp.
void configure_threads_and_report(const TrainOptions& o, const TrainingRun& run) {
  const WorkerEnvironment& env = run.env();
  if (env.distributed()) {
    spdlog::info("world: {} ranks from {} variables, this is rank {} (local rank {} of {}, node {})", env.world_size,
                 env.source, env.rank, env.local_rank, env.local_world_size, env.node_rank);
  } else {
    spdlog::info("world: one process (no launcher variables found)");
  }
  const ThreadChoice& threads = run.plan.threads;
  ops::set_num_threads(threads.threads);
  spdlog::info("{}; {} intra-op thread{} for host kernels ({})", run.plan.device.log_line, threads.threads,
               threads.threads == 1 ? "" : "s", threads.reason);
  if (!threads.warning.empty()) spdlog::warn("{}", threads.warning);
  if (!run.plan.device.binding.warning.empty()) spdlog::warn("{}", run.plan.device.binding.warning);
  // Bound to fewer CPUs (taskset, mtrain-launch --cpu_bind, a cpuset) than threads: they
  // would take turns on the same cores, every kernel waiting for its slowest thread.
  if (const int cpus = usable_cpu_count(); threads.threads > cpus) {
    spdlog::warn("{} intra-op threads but this process may run on {} CPU{} only (its affinity mask): the threads "
                 "will time-share; use --threads {}",
                 threads.threads, cpus, cpus == 1 ? "" : "s", cpus);
  }
  if (run.plan.speedups.any()) spdlog::info("speedups (MTRAIN_SPEEDUPS): {}", run.plan.speedups.str());
  if (run.plan.amp != DType::Float32) {
    spdlog::info("--amp {}: convolutions and linear layers multiply in {}, everything else stays float32{}", o.amp.text,
                 dtype_name(run.plan.amp), uses_loss_scaler(o) ? "; dynamic loss scaling" : "");
  }
}

// Note [A stop signal during start-up]: a process that called MPI_Init must not end
// without MPI_Finalize (mpirun would take the stop for a crash), so under MPI the first
// stop signal waits for the first step, as every stop signal once did. Note
// [Control-plane collectives] (ddp/training_groups.cpp): `gradients` carries tensors on
// the training device, `control` host values; one object unless the backend is NCCL.
void join_process_groups(const TrainOptions& o, TrainingRun& run, StartupStop& startup) {
  const std::string& backend = run.plan.backend();
  if (backend == "mpi" || run.env().store_mode == StoreMode::kMpiBroadcast) startup.disarm();
  ProcessGroupOptions pg_options;
  pg_options.timeout = Millis(static_cast<int64_t>(o.timeout_seconds * 1000.0));
  if (run.env().distributed()) {
    // No store for the MPI backend under an MPI starter, which bootstraps itself.
    // The store is waited for no longer than a collective would be (--timeout), nor than
    // the store's own default.
    StoreConnection store =
        open_worker_store(run.env(), o.unauthenticated_store, std::min(kDefaultStoreTimeout, pg_options.timeout));
    pg_options.rendezvous_host = store.host;
    pg_options.rendezvous_port = store.port;
    run.groups = create_training_groups(backend, std::move(store.store), run.env().rank, run.env().world_size,
                                        run.plan.device.binding.device, pg_options);
  } else if (backend == "nccl") {
    run.groups = create_single_rank_nccl_groups(run.compute(), pg_options);
  }
  if (const TrainingGroups& g = run.groups) {
    spdlog::info("process group: {} backend, {} ranks, collective timeout {} s{}", g.gradients->backend_name(),
                 g.gradients->size(), o.timeout_seconds,
                 g.control != g.gradients ? fmt::format("; host values on a separate {} group", g.control->backend_name())
                                          : std::string());
  }
}

// The datasets, then the check that every rank trains the same configuration on the
// same data, then SyncBatchNorm's group (Note [SyncBatchNorm's own group]: right after
// the check, which proved that every rank runs --sync-bn, and before anything one rank
// alone could fail at, such as a weights file, while the others waited in its
// rendezvous).
void load_data(const TrainOptions& o, TrainingRun& run) {
  const data::DataSource& source = run.plan.data;
  spdlog::info("data: {}", source.description);
  const data::SyntheticOptions synthetic = synthetic_options(o);
  data::DatasetSplits splits =
      data::load_splits(source, synthetic, image_folder_options(o),
                        streamed_options(o));
  for (const std::string& note : splits.notes) spdlog::warn("{}", note);
  run.train_set = std::make_shared<const data::Dataset>(std::move(splits.train));
  run.test_set = std::make_shared<const data::Dataset>(std::move(splits.test));
  spdlog::info("train set: {}", run.train_set->describe());
  spdlog::info("test set: {}", run.test_set->describe());
  // Found now rather than at the first evaluation, an epoch later.
  if (const data::ImageShape a = run.train_set->shape(), b = run.test_set->shape(); !(a == b)) {
    throw IoError(fmt::format("{}: the training images are {}x{}x{} but the test images {}x{}x{}; both "
                              "splits must come from one dataset",
                              source.description, a.channels, a.height, a.width, b.channels, b.height, b.width));
  }
  // With --no-eval nothing reads the test images again (Fashion-MNIST's: 7.5 MiB).
  if (!o.eval) run.test_set.reset();
  ProcessGroup* control = run.control();
  if (control != nullptr || !o.checkpoint_dir.empty()) run.fingerprint = dataset_fingerprint(*run.train_set);
  if (control != nullptr) {
    require_same_on_all_ranks(
        *control, training_configuration(o, run.train_set->size(), run.fingerprint, run.compute()),
        "the training configuration");
  }
  if (o.sync_bn && run.groups) run.batch_stats_group = create_batch_stats_group(run.groups);
}

// The model rewrites among the speed switches (Note [Speed switches] in core/speedups.h),
// after the SyncBatchNorm conversion and before anything hooks into the parameters.
void apply_speedups(const Speedups& speedups, models::Module& model) {
  if (speedups.fused_bn) {
    const int folded = models::fuse_batchnorm(model);
    spdlog::info("speedup fused-bn: batch norms in the fused kernels, {} ReLUs folded into them", folded);
  }
  if (speedups.skip_conv_bias) {
    const int skipped = models::skip_conv_bias(model);
    spdlog::info("speedup skip-conv-bias: {} convolutions leave their bias to the batch norm after them",
                 skipped);
  }
}

// MTRAIN_SPEEDUPS=amp-activations (Note [Mixed precision] in models/mixed_precision.cpp):
// a switch, so a model or precision it does not apply to is a log line, not an error.
void use_16bit_activations(const TrainOptions& o, const TrainingRun& run, models::Module& model) {
  if (!run.plan.speedups.amp_activations) return;
  if (run.plan.amp == DType::Float32) {
    spdlog::info("speedup amp-activations: not used without --amp; the activations stay float32");
    return;
  }
  if (run.compute().is_cpu()) {
    // Note [Ops on 16-bit storage] in tensor/ops.cpp: no CPU kernel reads 16 bits itself.
    spdlog::info("speedup amp-activations: not used on the CPU, whose kernels would compute on float32 copies of "
                 "16-bit activations; the activations stay float32");
    return;
  }
  const models::ActivationStorage storage = models::set_activation_dtype(model, run.plan.amp);
  if (!storage.refused.empty()) {
    spdlog::info("speedup amp-activations: not used: in model {}, {}", o.model, storage.refused);
    return;
  }
  spdlog::info("speedup amp-activations: {} convolutions pass their outputs on as {}", storage.convolutions,
               dtype_name(run.plan.amp));
}

// --channels-last (Note [Channels-last models] in models/rewrites.h).
void use_channels_last(const TrainOptions& o, const TrainingRun& run, models::Module& model) {
  if (!o.channels_last) return;
  const int switched = models::use_channels_last(model);
  if (switched == 0) {
    spdlog::info("--channels-last: model {} has no convolution, so no layout to choose; nothing changed", o.model);
  } else {
    spdlog::info("--channels-last: {} layers of model {} keep their activations [N, H, W, C]{}", switched, o.model,
                 run.compute().is_cpu() ? " (on the CPU that only costs: its kernels run NCHW between transposes)"
                                        : "");
  }
}

// Built and initialised on the host (the seeded generators fill host tensors, so every
// device starts from the same weights), moved before anything holds views of its
// gradients (the reducer's buckets) or state derived from it (momentum), then every
// replica takes rank 0's weights and buffers, whatever its seed or file.
void build_model(const TrainOptions& o, TrainingRun& run) {
  models::InitOptions init;
  init.scheme = o.init.value;
  init.seed = o.seed;
  run.model = models::build_model_for_images(o.model, run.train_set->channels(), run.train_set->height(),
                                             run.train_set->width(), run.train_set->num_classes(), init);
  models::Module& model = *run.model;
  if (!o.init_from.empty()) {
    load_model_weights(o.init_from, model);
    spdlog::info("model {}: weights from {}", o.model, o.init_from);
  } else if (o.init.value == models::InitScheme::kGraph) {
    spdlog::info("model {}: the graph's {} layers, starting from its initializers", o.model,
                 model.named_modules().size() - 1);
  } else {
    spdlog::info("model {}: {} initialisation, seed {}", o.model, o.init.text, o.seed);
  }
  if (!o.recipe.empty()) {
    spdlog::info("model {}: its recipe sets {} (docs/training.md; a flag given overrides it)", o.model, o.recipe);
  }
  if (o.sync_bn && run.groups) {
    const int converted = models::convert_sync_batchnorm(model, run.batch_stats_group);
    spdlog::info("--sync-bn: {} BatchNorm2d layers now synchronise their statistics over {} ranks", converted,
                 run.groups.gradients->size());
  } else if (o.sync_bn) {
    spdlog::info("--sync-bn: a world of one, so BatchNorm2d already sees the whole batch; nothing converted");
  }
  if (run.plan.amp != DType::Float32) models::set_compute_dtype(model, run.plan.amp);
  apply_speedups(run.plan.speedups, model);
  use_16bit_activations(o, run, model);
  use_channels_last(o, run, model);
  // Nothing uses the gradient of the images: the first layer skips computing it.
  model.set_input_grad_needed(false);
  model.to(run.compute());
  if (run.groups) broadcast_module_state(*run.groups.gradients, model);
  spdlog::info("model {}: {} parameters in {} tensors, {} buffers", o.model, model.num_parameter_elements(),
               model.parameters().size(), model.buffers().size());
}

// Note [Room for the outputs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A run that trains for hours must not learn at its end that its final weights have no
// room. Before the first step rank 0, the only writer, checks that --save-final's
// directory has room for the weights and --checkpoint-dir's for one more checkpoint (the
// weights and the momentum buffers: the incoming file is written before the oldest goes,
// Note [The previous checkpoint] in checkpoint/checkpointer.cpp), with 1 MiB to spare for
// the headers; every rank stops with the same error when not (share_outcome). A disk that
// fills up during the run is still possible: the final write then keeps the weights in
// the temporary directory (save_model_weights_or_keep), and --metrics, --plot and --trace
// only warn and stop writing.
void check_room_for_outputs(const TrainOptions& o, const TrainingRun& run) {
  std::exception_ptr failure;
  if (run.lead()) {
    try {
      uint64_t weights = 0, parameters = 0;
      for (const models::NamedParameter& p : run.model->parameters()) parameters += p.param->value.nbytes();
      for (const models::NamedBuffer& b : run.model->buffers()) weights += b.buffer->nbytes();
      weights += parameters;
      constexpr uint64_t kSpare = uint64_t{1} << 20;
      const auto require = [](const std::string& flag, const std::string& place, const std::string& dir,
                              const std::string& what, uint64_t need) {
        // The checkpoint directory is created later: ask the filesystem it will be on.
        std::filesystem::path existing = std::filesystem::absolute(dir);
        std::error_code ec;
        while (!std::filesystem::exists(existing, ec) && existing.has_parent_path() &&
               existing.parent_path() != existing) {
          existing = existing.parent_path();
        }
        const uint64_t available = free_bytes(existing.empty() ? "." : existing.string());
        if (available >= need) return;
        throw InvalidArgument(fmt::format("{} {}: {} has {:.1f} MiB free, {} take {:.1f} MiB; free some space or "
                                          "choose another place",
                                          flag, place, dir, static_cast<double>(available) / (1 << 20), what,
                                          static_cast<double>(need) / (1 << 20)));
      };
      for (const auto& [flag, file] : {std::pair{"--save-final", &o.save_final}, {"--save-onnx", &o.save_onnx}}) {
        if (file->empty()) continue;
        const std::filesystem::path parent = std::filesystem::path(*file).parent_path();
        require(flag, *file, parent.empty() ? "." : parent.string(), "the final weights", weights + kSpare);
      }
      if (!o.checkpoint_dir.empty()) {
        const uint64_t momentum = o.momentum > 0 ? parameters : 0;
        require("--checkpoint-dir", o.checkpoint_dir, o.checkpoint_dir, "a checkpoint's weights and momentum",
                weights + momentum + kSpare);
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  share_outcome(run.control(), run.env().rank, failure);
}

void make_optimizer(const TrainOptions& o, TrainingRun& run) {
  const int world = run.env().world_size;
  run.world_scale = o.lr_scaling.value == LrScaling::kLinear && !o.global_batch_size ? static_cast<double>(world) : 1.0;
  if (o.warmup_epochs > 0 && run.world_scale == 1.0) {
    spdlog::warn("--warmup-epochs {}: the warm-up ramps from --lr to the scaled rate, which is --lr itself here "
                 "(--lr-scaling {}, {} rank{}), so the rate stays at {} until the schedule starts",
                 o.warmup_epochs, o.lr_scaling.text, world, world == 1 ? "" : "s", o.lr);
  }
  models::SgdOptions sgd;
  sgd.lr = static_cast<float>(o.lr * run.world_scale);
  sgd.momentum = static_cast<float>(o.momentum);
  sgd.weight_decay = static_cast<float>(o.weight_decay);
  sgd.nesterov = o.nesterov;
  run.optimizer = std::make_unique<models::Sgd>(*run.model, sgd);
  spdlog::info("optimizer: SGD lr {} momentum {} weight decay {}{}", sgd.lr, o.momentum, o.weight_decay,
               o.nesterov ? " nesterov" : "");
}

// Note [Resuming in another world] in loop/train_loop.cpp: with a per-rank batch the new
// world's sampler shards what the checkpoint's worlds left of their epoch, and this run's
// positions list them as the epoch's earlier worlds. One line says what changed, and the log
// line below then counts the epoch's steps in this world.
void continue_in_another_world(const TrainOptions& o, TrainingRun& run, TrainPosition& r) {
  const int world = run.env().world_size;
  if (!o.global_batch_size) {
    if (r.epoch_consumed < 0) {
      throw InvalidArgument(fmt::format(
          "checkpoint {} was written by {} rank(s) and by an mtrain-train that did not record how much of the "
          "epoch they trained on; resume it with {} rank(s), or with --global-batch-size",
          run.checkpointer->path(), r.world_size, r.world_size));
    }
    if (run.train.shard_sampler) run.train.shard_sampler->resume_epoch(r.epoch - 1, r.epoch_consumed);
    if (run.train.stream_sampler) {
      // Only a streamed set needs the epoch's worlds (Note [An epoch of shards in several
      // worlds]); an in-memory one's rest follows from the count.
      if (r.earlier_segments.size() >= kMaxEarlierSegments) {
        throw InvalidArgument(fmt::format("checkpoint {}: epoch {} has been continued in {} worlds, the most one epoch "
                                          "records; start that epoch over from an earlier checkpoint or afresh",
                                          run.checkpointer->path(), r.epoch, r.earlier_segments.size() + 1));
      }
      int64_t earlier = 0;
      for (const EpochSegment& s : r.earlier_segments) earlier += s.consumed;
      r.earlier_segments.push_back({r.world_size, r.epoch_consumed - earlier});
      std::vector<data::ShardSampler::EarlierWorld> worlds;
      for (const EpochSegment& s : r.earlier_segments) worlds.push_back({s.world_size, s.consumed});
      run.train.stream_sampler->resume_epoch(r.epoch - 1, std::move(worlds));
    }
    run.resumed_rest_only = true;
  }
  const std::string worlds =
      r.world_size == world ? fmt::format("epoch {} was begun in another world: its worlds", r.epoch)
                            : fmt::format("world {} -> {}: the checkpoint's {} rank(s)", r.world_size, world, r.world_size);
  spdlog::info("{} took {} of epoch {}'s items in {} step(s); {}", worlds,
               std::min(r.epoch_consumed, run.train_set->size()), r.epoch, r.steps_in_epoch,
               o.global_batch_size
                   ? fmt::format("--global-batch-size {} keeps every step's images, now split over {} rank(s)",
                                 *o.global_batch_size, world)
                   : fmt::format("--batch-size {} per rank: {} images per step from here, the rest of the epoch "
                                 "re-sharded over {} rank(s)",
                                 o.batch_size, items_per_step(o, world), world));
}

void resume_from_checkpoint(const TrainOptions& o, TrainingRun& run, StartupStop& startup) {
  if (o.checkpoint_dir.empty()) return;
  run.checkpointer = std::make_unique<Checkpointer>(
      o.checkpoint_dir, run.groups.gradients.get(), run.env().rank, *run.model, *run.optimizer,
      resume_configuration(o, run.train_set->size(), run.fingerprint), run.control());
  run.resumed = run.checkpointer->resume();
  if (auto& r = run.resumed) {
    startup.at_position(r->epoch, r->total_steps);
    // An epoch begun in an earlier world continues as its rest, also in that world again:
    // a streamed set records the worlds, an in-memory one took other than this world's
    // steps would have.
    const bool other_world = r->world_size != run.env().world_size || !r->earlier_segments.empty() ||
                             (!o.global_batch_size && r->epoch_consumed >= 0 &&
                              r->epoch_consumed != r->steps_in_epoch * items_per_step(o, run.env().world_size));
    if (other_world) continue_in_another_world(o, run, *r);
    // Only the resumed epoch's rest has another size: count it (0-based epoch r->epoch - 1;
    // the loader sets it again when it starts that epoch).
    if (run.resumed_rest_only) run.train.loader->sampler().set_epoch(r->epoch - 1);
    const int64_t per_epoch = (run.resumed_rest_only ? r->steps_in_epoch : 0) +
                              steps_per_epoch(run.train.loader->num_batches(), o.grad_accum);
    // An epoch summarised at a --max-steps cut is "finished" in the file but not done.
    const std::string where =
        !r->epoch_finished ? fmt::format("epoch {}, {} of its {} steps done", r->epoch, r->steps_in_epoch, per_epoch)
        : r->steps_in_epoch >= per_epoch
            ? fmt::format("epoch {} finished", r->epoch)
            : fmt::format("epoch {} stopped by --max-steps after {} of its {} steps; the rest of it follows",
                          r->epoch, r->steps_in_epoch, per_epoch);
    const std::string& file = run.checkpointer->resumed_from();
    spdlog::info("resuming from {}: {}, {} steps in total", file.empty() ? run.checkpointer->path() : file, where,
                 r->total_steps);
  } else {
    spdlog::info("checkpoints: none in {} yet; this run starts from the beginning and writes {}", o.checkpoint_dir,
                 run.checkpointer->path());
  }
}

// --balance's first shares (the even split for auto), checked against the world; none
// for even, which keeps torch.chunk's split.
std::optional<std::vector<int64_t>> initial_shares(const TrainOptions& o, int world) {
  const BalanceSpec& spec = o.balance.value;
  if (spec.kind == BalanceSpec::Kind::kEven) return std::nullopt;
  const int64_t g = *o.global_batch_size;
  // Not torch.chunk's split, which leaves ranks empty (6 on 4: 2,2,2,0) that auto would
  // then never measure.
  if (spec.kind == BalanceSpec::Kind::kAuto) return data::apportion(g, std::vector<int64_t>(world, 1), 1);
  int64_t sum = 0;
  for (int64_t s : spec.shares) sum += s;
  if (static_cast<int>(spec.shares.size()) != world || sum != g) {
    throw InvalidArgument(fmt::format("--balance {}: expected {} share{} (one per rank) summing to --global-batch-size "
                                      "{}, found {} summing to {}",
                                      o.balance.text, world, world == 1 ? "" : "s", g, spec.shares.size(), sum));
  }
  if (spec.shares[0] == 0) {
    throw InvalidArgument(fmt::format(
        "--balance {}: expected rank 0's share >= 1, found 0: every rank takes rank 0's BatchNorm statistics, which "
        "a rank without images never updates",
        o.balance.text));
  }
  return spec.shares;
}

// A rank with an empty share skips forward (Note [Gradients are views into the
// buckets]), but SyncBatchNorm's forward is a collective every rank must join.
void require_every_rank_a_share(const TrainOptions& o, const data::GlobalBatchShardSampler& sampler, int world) {
  if (sampler.steps() == 0) return;
  for (const int64_t step : {int64_t{0}, sampler.steps() - 1}) {
    const std::vector<int64_t> shares = sampler.chunks(step);
    if (std::find(shares.begin(), shares.end(), 0) != shares.end()) {
      const int64_t batch = std::accumulate(shares.begin(), shares.end(), int64_t{0});
      throw InvalidArgument(fmt::format(
          "--sync-bn with --global-batch-size {}{}: a global batch of {} images is split {} between the {} ranks, "
          "and SyncBatchNorm needs every rank in every forward; choose a global batch size (or shares) that gives "
          "every rank at least one image, in the epoch's last batch too",
          *o.global_batch_size,
          o.balance.value.kind == BalanceSpec::Kind::kEven ? "" : fmt::format(" and --balance {}", o.balance.text), batch,
          format_shares(shares), world));
    }
  }
}

// The distributed samplers in a world of one are the plain shuffled (or sequential)
// order, so one rank with batch N*B reads exactly what N ranks with batch B read.
// --normalize's means and stds: given, or computed once from the training set (every
// rank loads the whole set, so every rank computes the same values).
data::ChannelStats normalization(const TrainOptions& o, const data::Dataset& train_set) {
  const Normalization& n = o.normalize.value;
  data::ChannelStats stats{n.mean, n.std};
  if (n.automatic && !train_set.in_memory()) {
    throw InvalidArgument(fmt::format("--normalize auto computes the mean and std from every training image, which {} "
                                      "streams from its files; give the values (ImageNet's: "
                                      "--normalize 0.485,0.456,0.406:0.229,0.224,0.225)",
                                      train_set.name()));
  }
  if (n.automatic) {
    stats = data::channel_stats(train_set);
    spdlog::info("--normalize auto: {}'s per-channel mean {:.4f} and std {:.4f}", train_set.name(),
                 fmt::join(stats.mean, ","), fmt::join(stats.std, ","));
  }
  const auto channels = static_cast<size_t>(train_set.channels());
  if (!stats.mean.empty() && stats.mean.size() != 1 && stats.mean.size() != channels) {
    throw InvalidArgument(fmt::format("--normalize: expected 1 or {} values each ({} has {} channel(s)), found {}",
                                      channels, train_set.name(), channels, stats.mean.size()));
  }
  return stats;
}

void make_loaders(const TrainOptions& o, TrainingRun& run) {
  const int rank = run.env().rank, world = run.env().world_size;
  const bool pinned = run.compute().is_cuda();
  const data::ChannelStats norm = normalization(o, *run.train_set);
  run.train = make_train_loader(o, run.train_set, rank, world, pinned, norm);
  if (run.train.global_batch_sampler && o.sync_bn && run.groups) {
    require_every_rank_a_share(o, *run.train.global_batch_sampler, world);
  }
  if (o.eval) {
    // Per rank, the largest training share (a global batch's first chunk), not G itself.
    const int64_t eval_batch = o.global_batch_size ? (*o.global_batch_size + world - 1) / world : o.batch_size;
    run.test_loader = make_loader(o, run.test_set,
                                  std::make_shared<data::EvalShardSampler>(run.test_set->size(), rank, world),
                                  eval_batch, pinned, norm);
  }
  spdlog::info("train loader: {}", run.train.loader->describe());
}

void attach_gradient_sync(const TrainOptions& o, TrainingRun& run) {
  if (run.groups) {
    ReducerOptions ro;
    ro.bucket_cap_bytes = static_cast<size_t>(o.bucket_cap_mb * 1024.0 * 1024.0);
    ro.compression = o.grad_compression.value;
    ro.weight_by_sample_count = o.global_batch_size.has_value();
    auto reducer = std::make_unique<Reducer>(run.groups.gradients, ro, run.groups.control);
    run.reducer = reducer.get();
    run.sync = std::move(reducer);
  } else {
    run.sync = std::make_unique<LocalGradients>();
  }
  run.exchange = std::make_unique<StepExchange>(run.groups ? run.groups.control : nullptr, run.compute());
  // Note [Set-up memory]
  // ~~~~~~~~~~~~~~~~~~~~
  // Set-up leaves large blocks in the host allocator's cache: the flat buffer that
  // broadcast the model state (as large as the model) and, once the reducer has
  // re-seated the gradients into its buckets, the old gradients (as large again). A
  // cached block serves any request up to half its size (Note [Host caching
  // allocator]), so a bucket would take the broadcast buffer and hold the difference
  // idle for the whole run. Returning the cache to the system before and after
  // attaching leaves the buckets in blocks of their own size (docs/benchmarks.md).
  host_allocator_release_cache();
  run.sync->attach(*run.model);
  host_allocator_release_cache();
  spdlog::info("gradients: {}", run.sync->describe());
}

}  // namespace

TrainLoader make_train_loader(const TrainOptions& o, std::shared_ptr<const data::Dataset> train_set, int rank, int world,
                              bool pinned, const data::ChannelStats& norm) {
  const int64_t train_size = train_set->size();
  data::Augmentation augment;
  augment.crop_padding = o.random_crop.value_or(-1);
  augment.horizontal_flip = o.random_flip;
  augment.seed = o.seed;
  const data::Permutation permutation = o.shuffle_order.value;
  TrainLoader t;
  if (o.global_batch_size) {
    auto sampler = std::make_shared<data::GlobalBatchShardSampler>(train_size, rank, world, *o.global_batch_size,
                                                                   o.shuffle, o.seed, o.drop_last, permutation);
    if (const auto shares = initial_shares(o, world)) sampler->set_shares(0, *shares);
    t.global_batch_sampler = sampler;
    t.loader = make_loader(o, train_set, sampler, *o.global_batch_size, pinned, norm, augment);
  } else if (const data::EncodedImages* files = train_set->encoded(); files != nullptr && files->sharded()) {
    data::ShardSamplerOptions so{.shuffle = o.shuffle, .seed = o.seed, .drop_last = o.drop_last, .buffer = o.shuffle_buffer};
    auto sampler = std::make_shared<data::ShardSampler>(files->file_starts(), rank, world, so);
    t.stream_sampler = sampler;
    t.loader = make_loader(o, train_set, sampler, o.batch_size, pinned, norm, augment);
  } else {
    auto sampler =
        std::make_shared<data::DistributedSampler>(train_size, rank, world, o.shuffle, o.seed, o.drop_last, permutation);
    t.shard_sampler = sampler;
    t.loader = make_loader(o, train_set, sampler, o.batch_size, pinned, norm, augment);
  }
  return t;
}

// Note [When the shares change] in ddp/share_policy.cpp. Built after set_up_run, since it holds
// references into the run (its metrics writer), which must not move afterwards.
std::unique_ptr<BatchResplitter> start_balance(const TrainOptions& o, TrainingRun& run) {
  const BalanceSpec& spec = o.balance.value;
  if (spec.kind == BalanceSpec::Kind::kEven) return nullptr;
  if (!run.groups) {
    spdlog::info("--balance {}: a world of one takes the whole global batch; nothing to balance", o.balance.text);
    return nullptr;
  }
  BalanceOptions options;
  options.global_batch = *o.global_batch_size;
  options.initial_shares = run.train.global_batch_sampler->shares();
  options.automatic = spec.kind == BalanceSpec::Kind::kAuto;
  options.allow_empty_share = !o.sync_bn;
  spdlog::info("--balance {}: shares {}{}", o.balance.text, format_shares(options.initial_shares),
               options.automatic ? ", then in proportion to each rank's measured compute time per image" : "");
  return std::make_unique<BatchResplitter>(SharePolicy(options), *run.train.global_batch_sampler, *run.train.loader,
                                        *run.exchange, run.metrics);
}

namespace {

void plan_learning_rate(const TrainOptions& o, TrainingRun& run) {
  const int64_t per_epoch = steps_per_epoch(run.train.loader->num_batches(), o.grad_accum);
  double run_epochs = static_cast<double>(o.epochs);
  if (o.max_steps && per_epoch > 0) {
    run_epochs = std::min(run_epochs, static_cast<double>(*o.max_steps) / static_cast<double>(per_epoch));
  }
  LrScheduleOptions lr;
  lr.base_lr = o.lr;
  lr.world_scale = run.world_scale;
  lr.warmup_epochs = o.warmup_epochs;
  lr.total_epochs = std::max(run_epochs, 1e-9);
  lr.kind = o.lr_schedule.value;
  run.schedule = std::make_unique<LrSchedule>(lr);
  spdlog::info("learning rate: {}", run.schedule->describe());
}

}  // namespace

TrainingRun set_up_run(const TrainOptions& options, WorkerEnvironment env, StartupStop& startup) {
  TrainingRun run(plan_run(options, std::move(env)));
  open_outputs(options, run, startup);
  configure_threads_and_report(options, run);
  join_process_groups(options, run, startup);
  load_data(options, run);
  build_model(options, run);
  make_optimizer(options, run);
  check_room_for_outputs(options, run);
  make_loaders(options, run);
  resume_from_checkpoint(options, run, startup);
  attach_gradient_sync(options, run);
  plan_learning_rate(options, run);
  return run;
}

}  // namespace mtrain
