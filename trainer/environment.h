// Who this worker is and what it may use: its place in the world (rank, local rank,
// sizes) and its intra-op thread count.
//
// Note [World of one]
// ~~~~~~~~~~~~~~~~~~~
// mtrain-train has no process group yet, so every process trains a world of one. The
// full discovery contract (launcher / torchrun variables, then Open MPI, PMIx, SLURM;
// ARCHITECTURE.md "Environment") arrives with the process group; until then only the
// node-local size is read, because it decides the thread default, and a launcher-set
// WORLD_SIZE > 1 is reported so nobody mistakes N independent runs for one job.
#pragma once

#include <optional>
#include <string>

namespace mtrain {

struct WorkerEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  // ranks sharing this node, from LOCAL_WORLD_SIZE / Open MPI
  std::string local_world_size_source;  // the variable it came from; empty = default
  int requested_world_size = 1;         // WORLD_SIZE / OMPI_COMM_WORLD_SIZE as set, see the Note
  std::string requested_world_size_source;
};

// Reads the environment (see Note [World of one]). Throws InvalidArgument naming the
// variable when a value is not a positive integer.
WorkerEnvironment discover_environment();

struct ThreadChoice {
  int threads = 1;
  std::string reason;  // "--threads", "OMP_NUM_THREADS=4", "all 8 cores", ...
};

// The intra-op thread count: --threads if given, else OMP_NUM_THREADS if set (as
// PyTorch honours it), else 1 when several ranks share the node (as torchrun sets
// OMP_NUM_THREADS=1 there, so ranks do not oversubscribe the cores), else every core
// this process may run on (its CPU affinity mask, which respects taskset and cpusets).
ThreadChoice resolve_num_threads(std::optional<int> flag, const WorkerEnvironment& env);

// CPUs in this process's affinity mask (at least 1).
int usable_cpu_count();

}  // namespace mtrain
