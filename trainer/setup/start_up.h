// The start-up of a training run: the plan (run_plan.h: who this worker is, its device,
// backend, store, data), then named phases, in order, that build from it one plain struct
// holding everything the run needs (groups, datasets, model, optimizer, checkpoints, loaders,
// gradient synchronisation, schedule).
#pragma once

#include <memory>
#include <optional>

#include "collectives/process_group.h"
#include "core/speedups.h"
#include "data/dataloader.h"
#include "data/dataset.h"
#include "data/shard_sampler.h"
#include "models/module.h"
#include "models/optim.h"
#include "trainer/checkpoint/checkpointer.h"
#include "trainer/ddp/batch_resplitter.h"
#include "trainer/ddp/gradient_sync.h"
#include "trainer/ddp/reducer.h"
#include "trainer/ddp/step_exchange.h"
#include "trainer/ddp/training_groups.h"
#include "trainer/loop/lr_schedule.h"
#include "trainer/loop/metrics.h"
#include "trainer/loop/train_loop.h"
#include "trainer/options.h"
#include "trainer/setup/environment.h"
#include "trainer/setup/run_plan.h"
#include "trainer/stopping/stop_signals.h"

namespace mtrain {

// A run's training loader and the sampler it reads: one of the three, by the flags and the
// set (make_train_loader).
struct TrainLoader {
  std::shared_ptr<data::DataLoader> loader;
  std::shared_ptr<data::GlobalBatchShardSampler> global_batch_sampler;  // with --global-batch-size
  std::shared_ptr<data::DistributedSampler> shard_sampler;              // without it
  std::shared_ptr<data::ShardSampler> stream_sampler;                   // without it, for a streamed set
};

struct TrainingRun {
  explicit TrainingRun(RunPlan run_plan) : plan(std::move(run_plan)) {}

  // Who this worker is, where it trains, on what: decided before the rest, read only.
  const RunPlan plan;
  MetricsWriter metrics;       // enabled on rank 0 with --metrics
  // The process groups; empty in a world of one (except a one-rank NCCL group).
  TrainingGroups groups;
  std::shared_ptr<ProcessGroup> batch_stats_group;  // --sync-bn's (Note [SyncBatchNorm's own group])
  // Data: the test set is null under --no-eval.
  std::shared_ptr<const data::Dataset> train_set;
  std::shared_ptr<const data::Dataset> test_set;
  std::string fingerprint;  // of the training set, where a check needs it
  // What is trained.
  std::unique_ptr<models::Module> model;
  std::unique_ptr<models::Sgd> optimizer;
  double world_scale = 1.0;  // the learning rate's factor from --lr-scaling
  std::unique_ptr<Checkpointer> checkpointer;  // with --checkpoint-dir
  std::optional<TrainPosition> resumed;        // where a resumed run continues
  // How it is trained.
  TrainLoader train;
  // The resumed epoch's loader holds only what another world left of it (Note [Resuming
  // in another world] in loop/train_loop.cpp).
  bool resumed_rest_only = false;
  std::shared_ptr<data::DataLoader> test_loader;  // null under --no-eval
  std::unique_ptr<GradientSynchronizer> sync;
  Reducer* reducer = nullptr;  // `sync` when the run is data-parallel
  std::unique_ptr<StepExchange> exchange;  // each step's records, over the control group
  std::unique_ptr<LrSchedule> schedule;

  const WorkerEnvironment& env() const { return plan.env; }
  bool lead() const { return plan.env.rank == 0; }  // logs, writes metrics and final weights
  Device compute() const { return plan.compute(); }
  ProcessGroup* control() const { return groups.control.get(); }  // host values; null: none
};

// Runs the start-up phases for `options` on the worker `env` describes. `startup` is
// armed (a stop signal ends the worker at once) and learns the checkpoint a rerun would
// resume from. Throws the typed errors of the phases (InvalidArgument for a run that
// cannot start as asked, IoError for files, CommError for peers).
TrainingRun set_up_run(const TrainOptions& options, WorkerEnvironment env, StartupStop& startup);

// The training loader of a run of `options` for rank `rank` of `world` over `train_set`,
// and the sampler it reads (one of the three, by the flags and the set: Note [Shards per
// rank] in data/shard_sampler.cpp for sharded sets). `norm` is --normalize's values.
TrainLoader make_train_loader(const TrainOptions& options, std::shared_ptr<const data::Dataset> train_set, int rank,
                              int world, bool pinned, const data::ChannelStats& norm);

// --balance auto or static in a data-parallel run: the BatchResplitter that re-splits the global
// batches (it refers into `run`, which must stay where it is); null for --balance even and in
// a world of one.
std::unique_ptr<BatchResplitter> start_balance(const TrainOptions& options, TrainingRun& run);

}  // namespace mtrain
