// What a worker's run is, decided once at start-up right after its device is bound: who the
// worker is in which world and where its store is, where it trains and over which backend,
// with how many host threads, in which compute type with which speed switches, on which
// data. The phases after it (start_up.h) read the plan and decide none of it again (Note
// [The run plan] in run_plan.cpp).
#pragma once

#include "core/speedups.h"
#include "data/data_source.h"
#include "tensor/tensor.h"
#include "trainer/options.h"
#include "trainer/setup/device.h"
#include "trainer/setup/environment.h"

namespace mtrain {

struct RunPlan {
  WorkerEnvironment env;   // rank, world, and the store located for the backend below
  TrainingDevice device;   // the device bound, the backend resolved for it, and why
  ThreadChoice threads;    // intra-op threads for host kernels, and why
  DType amp = DType::Float32;  // the compute type of convolutions and linear layers
  Speedups speedups;       // MTRAIN_SPEEDUPS (Note [Speed switches] in core/speedups.h)
  data::DataSource data;   // --dataset and --data-dir resolved (the files are read later)

  const std::string& backend() const { return device.binding.backend; }  // resolved: gloo, mpi, nccl
  Device compute() const { return device.compute; }
};

// Binds the device of the worker `env` describes (Note [Device binding] in device.cpp),
// resolves --backend for it, locates the store for that backend, and resolves the rest of the
// plan from `options`. Throws InvalidArgument for a run that cannot start as asked (no GPU for
// --device cuda, nccl on the CPU, --amp a device cannot compute in, a store nowhere to be
// found) and IoError for data that is not there, before anything is loaded or joined.
RunPlan plan_run(const TrainOptions& options, WorkerEnvironment env);

}  // namespace mtrain
