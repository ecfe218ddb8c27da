#include "trainer/setup/environment.h"

#include <sched.h>

#include <cctype>
#include <cstdint>
#include <thread>

#include "collectives/process_group.h"
#include "core/env.h"
#include "core/error.h"
#include "core/text.h"
#include "trainer/setup/hostlist.h"

namespace mtrain {

namespace {

constexpr int kMaxWorld = 1 << 20;

class Reader {
 public:
  explicit Reader(const EnvLookup& lookup) : lookup_(lookup) {}

  bool has(const char* name) const { return lookup_(name).has_value(); }
  std::optional<std::string> str(const char* name) const { return lookup_(name); }
  std::optional<int> integer(const char* name, int min, int max) const {
    auto v = lookup_(name);
    if (!v) return std::nullopt;
    return static_cast<int>(env::parse_int(*v, fmt::format("environment variable {}", name), min, max));
  }
  int required(const char* name, const char* because, int min, int max) const {
    auto v = integer(name, min, max);
    if (!v) throw InvalidArgument(fmt::format("environment variable {} is not set, but {}", name, because));
    return *v;
  }

 private:
  const EnvLookup& lookup_;
};

// Note [Environment discovery]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A worker learns its place from whoever started it. Sources are tried in this order and the
// first one present wins:
//   1. launcher / torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
//      MASTER_ADDR, MASTER_PORT (present when RANK or WORLD_SIZE is set);
//   2. Open MPI: OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}. It must beat SLURM:
//      under mpirun inside an allocation every rank sees SLURM_PROCID=0;
//   3. PMIx: PMIX_RANK (the size comes from SLURM_NTASKS, PMIx exports none);
//   4. SLURM: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, and the
//      first host of SLURM_JOB_NODELIST as the master when MASTER_ADDR is unset.
// Nothing set = a world of one. Contradictions are InvalidArgument naming the variable.
//
// The store (Note [Who hosts the store] in worker_store.cpp), located once the backend is
// resolved: mtrain-launch's when MTRAIN_RUN_ID
// says it started us; none for the MPI backend under mpirun or srun --mpi=pmix; else rank 0 hosts
// it at MASTER_ADDR:MASTER_PORT, where under SLURM the address defaults to the first host of
// SLURM_JOB_NODELIST (hostlist.h) and the port to 10000 + SLURM_JOB_ID % 20000; under mpirun
// without MASTER_ADDR its address travels over MPI instead.
void check_rank(int rank, const char* rank_name, int size, const char* size_name) {
  if (rank >= size) {
    throw InvalidArgument(fmt::format("environment variable {}={} must be smaller than {}={}", rank_name, rank,
                                      size_name, size));
  }
}

// A launcher variable beside the Open MPI one must say the same thing.
void check_agrees(const Reader& r, const char* name, const char* ompi_name) {
  const auto a = r.integer(name, 0, kMaxWorld);
  const auto b = r.integer(ompi_name, 0, kMaxWorld);
  if (a && b && *a != *b) {
    throw InvalidArgument(fmt::format("environment variable {}={} contradicts {}={} set by mpirun", name, *a,
                                      ompi_name, *b));
  }
}

// Leading integer of SLURM_NTASKS_PER_NODE ("4(x2)" or "2,1" -> 4 / 2). The whole
// value must have SLURM's form, counts with optional repeats joined by commas.
std::optional<int> leading_count(const std::optional<std::string>& text) {
  if (!text) return std::nullopt;
  // N or N(xM), joined by commas (a scan: std::regex recurses per repeat and a long
  // value would overflow the stack).
  const auto digits_at = [&](size_t i) {
    size_t j = i;
    while (j < text->size() && std::isdigit(static_cast<unsigned char>((*text)[j]))) ++j;
    return j - i;
  };
  bool well_formed = true;
  for (size_t i = 0; well_formed;) {
    const size_t count = digits_at(i);
    well_formed = count > 0;
    i += count;
    if (well_formed && text->compare(i, 2, "(x") == 0) {
      const size_t repeat = digits_at(i + 2);
      well_formed = repeat > 0 && i + 2 + repeat < text->size() && (*text)[i + 2 + repeat] == ')';
      i += 3 + repeat;
    }
    if (i == text->size()) break;
    well_formed = well_formed && (*text)[i] == ',';
    ++i;
  }
  if (!well_formed) {
    throw InvalidArgument(fmt::format("environment variable SLURM_NTASKS_PER_NODE: expected tasks per node as SLURM "
                                      "writes them (4, 2(x3) or 2(x3),1), found '{}'",
                                      printable_text(*text, 200)));
  }
  return static_cast<int>(env::parse_int(
      text->substr(0, digits_at(0)),
      fmt::format("environment variable SLURM_NTASKS_PER_NODE ('{}')", printable_text(*text, 200)), 1, kMaxWorld));
}

// mtrain-launch sets MTRAIN_RUN_ID beside RANK. A worker it started is not an MPI
// process, whatever MPI or PMIx variables it inherited from the launcher's own starter.
bool started_by_mtrain_launch(const Reader& r) { return r.has("RANK") && r.has("MTRAIN_RUN_ID"); }

void read_launcher(const Reader& r, WorkerEnvironment& w) {
  w.source = "launcher";
  w.world_size = r.required("WORLD_SIZE", "RANK is set (a launcher sets both)", 1, kMaxWorld);
  w.rank = r.required("RANK", "WORLD_SIZE is set (a launcher sets both)", 0, kMaxWorld);
  check_rank(w.rank, "RANK", w.world_size, "WORLD_SIZE");
  // Under mtrain-launch, Open MPI's variables belong to whatever started the launcher
  // (mpirun -npernode 1 mtrain-launch ...), not to this worker.
  if (!started_by_mtrain_launch(r)) {
    check_agrees(r, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE");
    check_agrees(r, "RANK", "OMPI_COMM_WORLD_RANK");
  }
  w.local_world_size = r.integer("LOCAL_WORLD_SIZE", 1, kMaxWorld).value_or(w.world_size);
  w.local_world_size_source = r.has("LOCAL_WORLD_SIZE") ? "LOCAL_WORLD_SIZE" : "WORLD_SIZE";
  w.local_rank = r.integer("LOCAL_RANK", 0, kMaxWorld).value_or(w.rank);
  check_rank(w.local_rank, "LOCAL_RANK", w.local_world_size, w.local_world_size_source.c_str());
  if (w.local_world_size > w.world_size) {
    throw InvalidArgument(fmt::format("environment variable LOCAL_WORLD_SIZE={} exceeds WORLD_SIZE={}: a node "
                                      "cannot hold more ranks than the world",
                                      w.local_world_size, w.world_size));
  }
  w.node_rank = r.integer("GROUP_RANK", 0, kMaxWorld).value_or(0);
}

void read_open_mpi(const Reader& r, WorkerEnvironment& w) {
  w.source = "Open MPI";
  w.world_size = r.required("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK is set", 1, kMaxWorld);
  w.rank = r.required("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE is set", 0, kMaxWorld);
  check_rank(w.rank, "OMPI_COMM_WORLD_RANK", w.world_size, "OMPI_COMM_WORLD_SIZE");
  w.local_world_size = r.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxWorld).value_or(1);
  w.local_world_size_source = r.has("OMPI_COMM_WORLD_LOCAL_SIZE") ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "";
  w.local_rank = r.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxWorld).value_or(0);
  check_rank(w.local_rank, "OMPI_COMM_WORLD_LOCAL_RANK", w.local_world_size, "OMPI_COMM_WORLD_LOCAL_SIZE");
  w.node_rank = r.integer("OMPI_COMM_WORLD_NODE_RANK", 0, kMaxWorld).value_or(0);
  w.under_mpirun = true;
}

void read_slurm_layout(const Reader& r, WorkerEnvironment& w) {
  w.local_rank = r.integer("SLURM_LOCALID", 0, kMaxWorld).value_or(0);
  if (auto n = leading_count(r.str("SLURM_NTASKS_PER_NODE"))) {
    w.local_world_size = *n;
    w.local_world_size_source = "SLURM_NTASKS_PER_NODE";
    check_rank(w.local_rank, "SLURM_LOCALID", w.local_world_size, "SLURM_NTASKS_PER_NODE");
  }
  w.node_rank = r.integer("SLURM_NODEID", 0, kMaxWorld).value_or(0);
}

void read_pmix(const Reader& r, WorkerEnvironment& w) {
  w.source = "PMIx";
  w.rank = r.required("PMIX_RANK", "", 0, kMaxWorld);
  auto size = r.integer("SLURM_NTASKS", 1, kMaxWorld);
  if (!size) {
    throw InvalidArgument(fmt::format(
        "environment variable PMIX_RANK={} is set but the world size is unknown (PMIx exports none): "
        "set SLURM_NTASKS, or RANK and WORLD_SIZE", w.rank));
  }
  w.world_size = *size;
  check_rank(w.rank, "PMIX_RANK", w.world_size, "SLURM_NTASKS");
  read_slurm_layout(r, w);
}

void read_slurm(const Reader& r, WorkerEnvironment& w) {
  w.source = "SLURM";
  w.world_size = r.required("SLURM_NTASKS", "SLURM_PROCID is set", 1, kMaxWorld);
  w.rank = r.required("SLURM_PROCID", "", 0, kMaxWorld);
  check_rank(w.rank, "SLURM_PROCID", w.world_size, "SLURM_NTASKS");
  read_slurm_layout(r, w);
}

// The port a SLURM job's rank 0 hosts its store on when MASTER_PORT is unset: fixed by
// the job id, so every task of the job computes the same one and concurrent jobs on a
// node differ (ids 20000 apart collide; MASTER_PORT overrides). Stays below the usual
// ephemeral range (32768+), where the kernel hands out client ports.
int port_from_job_id(const std::string& job_id) {
  const int64_t id = env::parse_int(job_id, "environment variable SLURM_JOB_ID", 0, INT64_MAX);
  return static_cast<int>(10000 + id % 20000);
}

// Where the store is and who hosts it: Note [Who hosts the store] (worker_store.cpp).
void read_store(const Reader& r, const BackendInfo& backend, WorkerEnvironment& w) {
  if (!w.distributed()) return;
  w.job_id = r.str("SLURM_JOB_ID").value_or("");
  if (backend.bootstraps_without_store && w.mpi_launched) return;  // MPI bootstraps itself: no store
  if (w.source == "launcher" && r.has("MTRAIN_RUN_ID")) {
    w.store_mode = StoreMode::kLauncher;  // mtrain-launch hosts it and says where
  } else if (w.source == "launcher" && r.has("TORCHELASTIC_RUN_ID") &&
             r.str("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") {
    // torchrun's agent already serves PyTorch's TCPStore at MASTER_ADDR:MASTER_PORT: rank 0
    // could not bind it, and no rank could speak its protocol.
    throw InvalidArgument(
        "started by torchrun with its agent's store (TORCHELASTIC_USE_AGENT_STORE=True): that store speaks "
        "PyTorch's protocol, not mtrain's. Start the workers with mtrain-launch, which takes torchrun's flags");
  } else {
    w.store_mode = StoreMode::kRank0;
  }

  // mtrain-launch gives its own store's address in variables of its own; MASTER_ADDR and
  // MASTER_PORT are then the free port other frameworks' rank 0 hosts its store on
  // (Note [Worker rendezvous for other frameworks] in launcher/attempt.cpp).
  const bool launcher_store = w.store_mode == StoreMode::kLauncher && r.has("MTRAIN_STORE_ADDR");
  const char* addr_from = launcher_store ? "MTRAIN_STORE_ADDR" : "MASTER_ADDR";
  const char* port_from = launcher_store ? "MTRAIN_STORE_PORT" : "MASTER_PORT";
  auto addr = r.str(addr_from);
  if ((!addr || addr->empty()) && w.store_mode == StoreMode::kRank0) {
    if (w.under_mpirun) {
      w.store_mode = StoreMode::kMpiBroadcast;  // rank 0 picks host and port, MPI tells the rest
      return;
    }
    if (auto nodes = r.str("SLURM_JOB_NODELIST"); nodes && (w.source == "SLURM" || w.source == "PMIx")) {
      try {
        addr = expand_hostlist(*nodes).front();
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(fmt::format("environment variable SLURM_JOB_NODELIST: {}", e.what()));
      }
      addr_from = "the first host of SLURM_JOB_NODELIST";
    }
  }
  if (!addr || addr->empty()) {
    throw InvalidArgument(fmt::format(
        "environment variable {} is not set, but the world has {} ranks (from {}): set MASTER_ADDR and "
        "MASTER_PORT to rank 0's host and a free port, or start the workers with mtrain-launch{}",
        addr_from, w.world_size, w.source, w.under_mpirun ? " or use --backend mpi" : ""));
  }
  w.master_addr = *addr;

  if (auto port = r.integer(port_from, 1, 65535)) {
    w.master_port = *port;
  } else if (w.store_mode == StoreMode::kRank0 && !w.job_id.empty()) {
    w.master_port = port_from_job_id(w.job_id);
  } else {
    throw InvalidArgument(fmt::format(
        "environment variable {} is not set, but the world has {} ranks (the store's address {} is from {})",
        port_from, w.world_size, w.master_addr, addr_from));
  }

  if (w.store_mode == StoreMode::kLauncher) {
    w.store_prefix = r.str("MTRAIN_STORE_PREFIX").value_or("");
    return;  // the token is read when connecting (connect_store_from_env)
  }
  // Unset: no authentication, said plainly (Note [Workers without a shared secret] in
  // worker_store.cpp); never a token an outsider could compute.
  w.store_token = r.str("MTRAIN_STORE_TOKEN").value_or("");
}

}  // namespace

const char* store_mode_name(StoreMode mode) {
  switch (mode) {
    case StoreMode::kNone: return "none";
    case StoreMode::kLauncher: return "launcher";
    case StoreMode::kRank0: return "rank 0";
    case StoreMode::kMpiBroadcast: return "MPI broadcast";
  }
  return "unknown";
}

WorkerEnvironment discover_environment(const EnvLookup& lookup) {
  const Reader r(lookup);
  WorkerEnvironment w;
  if (r.has("RANK") || r.has("WORLD_SIZE")) {
    read_launcher(r, w);
  } else if (r.has("OMPI_COMM_WORLD_RANK") || r.has("OMPI_COMM_WORLD_SIZE")) {
    read_open_mpi(r, w);
  } else if (r.has("PMIX_RANK")) {
    read_pmix(r, w);
  } else if (r.has("SLURM_PROCID")) {
    read_slurm(r, w);
  } else if (auto local = r.integer("LOCAL_WORLD_SIZE", 1, kMaxWorld)) {
    // A world of one that still shares its node (e.g. several jobs side by side).
    w.local_world_size = *local;
    w.local_world_size_source = "LOCAL_WORLD_SIZE";
  }
  const bool launched = started_by_mtrain_launch(r);
  w.under_mpirun = !launched && (w.under_mpirun || r.has("OMPI_COMM_WORLD_SIZE"));
  if (w.local_world_size_source.empty()) {
    if (auto local = r.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxWorld)) {
      w.local_world_size = *local;
      w.local_world_size_source = "OMPI_COMM_WORLD_LOCAL_SIZE";
    }
  }
  // PMIX_RANK makes an MPI process only when it names this worker: a launcher started
  // inside an srun task (srun torchrun ...) hands every worker the task's PMIX_RANK.
  const bool pmix_is_ours =
      r.has("PMIX_RANK") && (w.source != "launcher" || (r.integer("PMIX_RANK", 0, kMaxWorld) == w.rank &&
                                                         r.integer("SLURM_NTASKS", 1, kMaxWorld).value_or(w.world_size) ==
                                                             w.world_size));
  w.mpi_launched = !launched && (w.under_mpirun || pmix_is_ours);
  return w;
}

WorkerEnvironment discover_environment() {
  return discover_environment([](const char* name) { return env::get(name); });
}

void locate_store(const EnvLookup& lookup, const BackendInfo& backend, WorkerEnvironment& env) {
  read_store(Reader(lookup), backend, env);
}

void locate_store(const BackendInfo& backend, WorkerEnvironment& env) {
  locate_store([](const char* name) { return env::get(name); }, backend, env);
}

int usable_cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

ThreadChoice resolve_num_threads(std::optional<int> flag, const WorkerEnvironment& env) {
  if (flag) {
    if (*flag < 1) throw InvalidArgument(fmt::format("--threads: expected an integer >= 1, found {}", *flag));
    return {*flag, "--threads", {}};
  }
  std::string warning;
  if (auto omp = env::get("OMP_NUM_THREADS")) {
    // OpenMP allows a list, one count per nesting level ("4,2"); the first is ours. A value
    // that is no count ("0", "1 2") is what other programs would also ignore: it earns a
    // warning and the default, not the end of the run.
    const std::string first = omp->substr(0, omp->find(','));
    try {
      const auto n = env::parse_int(first, "OMP_NUM_THREADS", 1, 4096);
      return {static_cast<int>(n), fmt::format("OMP_NUM_THREADS={}", *omp), {}};
    } catch (const InvalidArgument&) {
      warning = fmt::format("environment variable OMP_NUM_THREADS='{}' is not a thread count (expected an "
                            "integer from 1 to 4096, or a comma-separated list of them); ignored",
                            *omp);
    }
  }
  if (env.local_world_size > 1) {
    return {1, fmt::format("1 per rank: {}={} ranks share this node", env.local_world_size_source,
                           env.local_world_size), warning};
  }
  const int cpus = usable_cpu_count();
  return {cpus, fmt::format("all {} usable cores", cpus), warning};
}

}  // namespace mtrain
