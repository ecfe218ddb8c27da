// Who this worker is and what it may use: its place in the world (rank, local rank, sizes, where
// the rendezvous store is and who hosts it), read from whichever starter's variables are present
// (launcher, then Open MPI, then PMIx, then SLURM; Note [Environment discovery] in
// environment.cpp), and its intra-op thread count. They only read the environment (through
// `lookup` where given); contradictions throw InvalidArgument naming the variable.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace mtrain {

struct BackendInfo;  // collectives/process_group.h

// Who hosts the rendezvous store: see Note [Who hosts the store] in worker_store.cpp.
enum class StoreMode { kNone, kLauncher, kRank0, kMpiBroadcast };
const char* store_mode_name(StoreMode mode);  // "none", "launcher", "rank 0", "MPI broadcast"

struct WorkerEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  // ranks sharing this node
  std::string local_world_size_source;  // the variable it came from; empty = default
  int node_rank = 0;                    // GROUP_RANK or SLURM_NODEID; 0 when unknown
  std::string source = "none";          // "launcher", "Open MPI", "PMIx", "SLURM" or "none"
  std::string master_addr;              // empty when not needed (world of one, MPI bootstrap)
  int master_port = 0;
  bool under_mpirun = false;            // OMPI_COMM_WORLD_SIZE is set
  bool mpi_launched = false;            // mpirun or a PMIx starter (srun --mpi=pmix): MPI_Init works
  StoreMode store_mode = StoreMode::kNone;
  std::string store_token;              // kRank0: MTRAIN_STORE_TOKEN; empty: none shared (no authentication)
  std::string store_prefix;             // MTRAIN_STORE_PREFIX (kLauncher), else empty
  std::string job_id;                   // SLURM_JOB_ID when set, for the derived port

  bool distributed() const { return world_size > 1; }
};

// Reads one environment variable: nullopt when unset (an empty value counts as set).
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

// Discovers the worker's place in the world (see Note [Environment discovery]) through
// `lookup`: everything but the store, which locate_store adds. Nothing set is a world of one.
// Throws InvalidArgument for a rank outside [0, size), half of a pair (RANK without
// WORLD_SIZE) or a launcher value that disagrees with Open MPI's beside it.
WorkerEnvironment discover_environment(const EnvLookup& lookup);
// The same over the process environment.
WorkerEnvironment discover_environment();

// Where the rendezvous store is and who hosts it (store_mode and what goes with it), for a run
// on `backend`, the resolved one: a backend that bootstraps itself under its starter (mpi under
// mpirun) needs none. Nothing for a world of one. Throws InvalidArgument for a world of
// several ranks whose store cannot be found.
void locate_store(const EnvLookup& lookup, const BackendInfo& backend, WorkerEnvironment& env);
// The same over the process environment.
void locate_store(const BackendInfo& backend, WorkerEnvironment& env);

struct ThreadChoice {
  int threads = 1;
  std::string reason;  // "--threads", "OMP_NUM_THREADS=4", "all 8 cores", ...
  std::string warning;  // non-empty: log it (an OMP_NUM_THREADS that is no count, ignored)
};

// The intra-op thread count: --threads if given, else OMP_NUM_THREADS if set (as
// PyTorch honours it), else 1 when several ranks share the node (as torchrun sets
// OMP_NUM_THREADS=1 there, so ranks do not oversubscribe the cores), else every core
// this process may run on (its CPU affinity mask, which respects taskset and cpusets).
ThreadChoice resolve_num_threads(std::optional<int> flag, const WorkerEnvironment& env);

// CPUs in this process's affinity mask (at least 1).
int usable_cpu_count();

}  // namespace mtrain
