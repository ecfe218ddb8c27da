#include "launcher/agent.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "launcher/attempt.h"
#include "launcher/failure_report.h"
#include "launcher/log_streams.h"
#include "launcher/rendezvous.h"
#include "launcher/signal_pipe.h"
#include "launcher/worker_process.h"

namespace mtrain::launch {
namespace {

namespace fs = std::filesystem;

// A terminating signal that arrived while no worker was running.
struct Interrupted {
  int signal;
};

std::string local_hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

std::string describe(const Failure& f) {
  std::string who = f.global_rank >= 0 ? fmt::format("rank {} (local_rank {}, node {}): {}",
                                                     f.global_rank, f.local_rank, f.node_rank,
                                                     f.status.describe())
                                       : fmt::format("node {}: {}", f.node_rank, f.message);
  if (f.global_rank >= 0 && !f.message.empty()) who += ": " + f.message;
  return who;
}

}  // namespace

struct Agent::Impl {
  Impl(const LaunchOptions& o, OrphanGuard& g) : options(o), job{o, g} {
    job.host = local_hostname();
  }
  ~Impl() {
    if (remove_run_dir) {
      std::error_code ec;
      fs::remove_all(job.run_dir, ec);
    }
  }

  int run();
  // Set-up, once per job.
  void prepare_job();
  std::string store_token() const;
  void bind_cpus();
  void choose_omp_threads();
  void prepare_run_dir();
  void open_store();
  // Between attempts.
  void check_interrupt();
  // `attempt` counts the restarts spent before it (re-forms spend none), as reports and
  // TORCHELASTIC_RESTART_COUNT number attempts.
  std::optional<int> conclude(const AttemptResult& r, int attempt);
  void print_stop_report(const AttemptResult& r, int attempt) const;
  void print_failure_report(const AttemptResult& r, int attempt, std::string restarts_unused_because);
  void keep_error_file(const std::string& error_file);
  void leave_store(int num_nodes, bool hosting);

  const LaunchOptions& options;
  Job job;
  bool remove_run_dir = false;
  int nodes_lost = 0;  // in the last attempt, found by their heartbeats: they never leave the store
};

Agent::Agent(const LaunchOptions& options, OrphanGuard& guard)
    : impl_(std::make_unique<Impl>(options, guard)) {}
Agent::~Agent() = default;
int Agent::run() { return impl_->run(); }

void Agent::Impl::check_interrupt() {
  for (int sig : job.signals->drain()) {
    if (SignalPipe::is_terminating(sig)) throw Interrupted{sig};
  }
}

void Agent::Impl::prepare_run_dir() {
  if (options.log_dir) {
    job.run_dir = *options.log_dir;
    std::error_code ec;
    fs::create_directories(job.run_dir, ec);
    if (ec) {
      throw IoError(fmt::format("--log_dir {}: cannot create it: {}", job.run_dir.string(),
                                ec.message()));
    }
    return;
  }
  std::string tmpl = (fs::temp_directory_path() / "mtrain-launch-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    throw IoError(fmt::format("cannot create a run directory {}: {}", tmpl, std::strerror(errno)));
  }
  job.run_dir = tmpl;
  // Error files are read before the launcher exits; redirected logs are the user's and
  // must survive, so the directory is only removed when nothing goes to a file.
  remove_run_dir = !LogStreams::needs_files(options);
  if (!remove_run_dir) {
    spdlog::info("worker logs go to {} (pass --log_dir to choose the place)", job.run_dir.string());
  }
}

void Agent::Impl::leave_store(int num_nodes, bool hosting) {
  if (num_nodes <= 1) return;
  num_nodes -= nodes_lost;
  const auto noop = [] {};
  try {
    if (hosting) {
      wait_for_others_to_leave(*job.store.client, job.run_id, num_nodes - 1,
                               std::chrono::duration_cast<Millis>(options.term_timeout +
                                                                  kRootCauseSlack),
                               noop);
    } else {
      announce_leaving(*job.store.client, job.run_id);
    }
  } catch (const Error& e) {
    spdlog::debug("leaving the store: {}", e.what());
  }
}

// Each pass is one round of the rendezvous and one attempt of the gang. The round number
// names the store keys; the restarts spent are counted apart, since a re-form for nodes
// waiting to join spends none (Note [Joining a running job] in rendezvous.cpp).
int Agent::Impl::run() {
  prepare_job();
  int previous_nodes = 0;
  int restarts_used = 0;
  int last_nodes = 0;  // the previous attempt's node count
  for (int round = 0;; ++round) {
    World world;
    try {
      world = rendezvous(*job.store.client, options, job.run_id, round, previous_nodes, job.store_address,
                         [this] { check_interrupt(); });
    } catch (const Interrupted& i) {
      spdlog::info("received {} while waiting for the other nodes; exiting",
                   signal_name(i.signal));
      return 128 + i.signal;
    }
    if (last_nodes > 0 && world.num_nodes != last_nodes) {
      spdlog::warn("the job now runs on {} node(s) instead of {}: {} rank(s), this node is node {}", world.num_nodes,
                   last_nodes, world.world_size, world.node_rank);
    }
    last_nodes = world.num_nodes;
    round = world.attempt;
    spdlog::debug("round {}: node {} of {}, ranks {}..{} of {}", round, world.node_rank,
                  world.num_nodes, world.rank_offset,
                  world.rank_offset + options.nproc_per_node - 1, world.world_size);

    const AttemptResult r = run_attempt(job, world, restarts_used);
    nodes_lost = r.nodes_lost;
    if (r.reform_nodes > 0) {
      spdlog::warn("re-forming the job with {} node(s) for the node(s) waiting to join; no restart spent",
                   r.reform_nodes);
      previous_nodes = r.reform_nodes;
      continue;
    }
    if (const std::optional<int> status = conclude(r, restarts_used)) {
      // Note [A lost store is not asked again] in attempt.cpp.
      if (!r.store_lost) leave_store(world.num_nodes, job.store.is_host());
      return *status;
    }
    ++restarts_used;
    previous_nodes = std::max(1, world.num_nodes - r.nodes_lost);
  }
}

// What every attempt shares, in the order its mistakes are best reported.
void Agent::Impl::prepare_job() {
  job.command = resolve_command(options);
  if (!job.command.interpreter.empty()) {
    spdlog::info("running {} with the Python interpreter {} (MTRAIN_PYTHON chooses another)", options.program,
                 job.command.interpreter);
  }
  job.token = store_token();
  job.run_id = options.standalone ? generate_store_token().substr(0, 12) : options.rdzv_id;
  bind_cpus();
  choose_omp_threads();
  prepare_run_dir();
  // Note [Worker process hygiene]: orphaned descendants come to us, not to init.
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    spdlog::warn("prctl(PR_SET_CHILD_SUBREAPER) failed ({}): a worker's orphaned descendants go to init, and the "
                 "teardown may miss them",
                 std::strerror(errno));
  }
  open_store();
  job.signals = &SignalPipe::install(options.signals_to_handle);
}

// Note [A token for the launchers' store]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One launcher makes its own random token and hands it to its workers. Launchers that
// share a store need one secret, which only the user can give them: MTRAIN_STORE_TOKEN.
// Except for a dynamic rendezvous whose endpoint is loopback: only this machine's
// processes can reach it (several launchers on one host, as `--nnodes=1:4
// --rdzv_endpoint=localhost:29400` runs them), so the store runs without a token, as
// torchrun's does, and the log says so. A static rendezvous keeps asking: its default
// --master_addr is loopback, and a job meant for several hosts that forgot it should
// hear about the token before it waits for nodes that cannot reach it.
std::string Agent::Impl::store_token() const {
  if (const auto t = env::get("MTRAIN_STORE_TOKEN"); t && !t->empty()) return *t;
  if (options.multi_node() && options.mode == RendezvousMode::kDynamic && loopback_only_address(options.store_host)) {
    spdlog::warn("MTRAIN_STORE_TOKEN is not set: the launchers' store on loopback ({}) admits every process of "
                 "this machine; set the same random MTRAIN_STORE_TOKEN for every launcher to require it",
                 options.store_host);
    return {};
  }
  if (options.multi_node()) {
    throw InvalidArgument(
        "MTRAIN_STORE_TOKEN is not set; a job on several nodes needs the same secret token "
        "on every node, e.g. `export MTRAIN_STORE_TOKEN=$(openssl rand -hex 32)` (or a value "
        "from your scheduler) before starting each node's launcher");
  }
  return generate_store_token();
}

void Agent::Impl::bind_cpus() {
  if (options.cpu_bind != CpuBind::kCores) return;
  job.worker_cpus = split_cpus(usable_cpus(), options.nproc_per_node);
  std::string shares;
  for (size_t local = 0; local < job.worker_cpus.size(); ++local) {
    shares += fmt::format("{}local rank {}: {}", local == 0 ? "" : ", ", local,
                          format_cpu_list(job.worker_cpus[local]));
  }
  spdlog::info("binding workers to CPUs ({})", shares);
}

void Agent::Impl::choose_omp_threads() {
  if (env::get("OMP_NUM_THREADS") || (options.nproc_per_node <= 1 && job.worker_cpus.empty())) return;
  job.set_omp_threads = true;
  if (job.worker_cpus.empty()) {
    spdlog::info("OMP_NUM_THREADS is not set; setting it to 1 for each of the {} workers so "
                 "they do not oversubscribe the CPUs (set it yourself to override)",
                 options.nproc_per_node);
  } else {
    spdlog::info("OMP_NUM_THREADS is not set; setting it to {} for each worker, the size of "
                 "its CPU share (set it yourself to override)", job.worker_cpus.front().size());
  }
}

void Agent::Impl::open_store() {
  job.store = open_agent_store(options, job.token);
  // The agents' requests are short and never wait for a key (rendezvous polls): a store
  // that does not answer within --heartbeat_timeout is lost (its host died without a
  // connection reset), not slow, and the agent must get back to its workers.
  job.store.client->set_timeout(std::chrono::duration_cast<Millis>(options.heartbeat_timeout));
  job.store_address = fmt::format("{}:{}", job.store.host, job.store.port);
}

// After attempt `attempt`: the launcher's exit status, its report printed; nullopt when
// the gang restarts instead.
std::optional<int> Agent::Impl::conclude(const AttemptResult& r, int attempt) {
  // Before anything else: a gang that stopped on a signal is neither a success nor a
  // failure to restart (Note [Workers stopped on a signal]).
  if (r.all_stopped) {
    print_stop_report(r, attempt);
    return kStoppedExitCode;
  }
  if (r.succeeded) return 0;
  // A signal to this launcher ends the job here whatever else happened: the user (or
  // the scheduler) asked for it.
  if (r.received_signal) {
    if (r.signal_after_failure) {
      spdlog::warn("attempt {} failed: {}; no restart: {} arrived while the workers were being stopped",
                   attempt, describe(r.root_cause), signal_name(*r.received_signal));
    }
    spdlog::info("stopped {} worker(s) after {}", options.nproc_per_node,
                 signal_name(*r.received_signal));
    return 128 + *r.received_signal;
  }
  // Note [Errors that will repeat]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A worker whose error cannot go away by running again (a bad flag, a missing or
  // corrupt file: mtrain-train's InvalidArgument and IoError) says so in its error file,
  // "will_repeat": true. Restarting would fail the same way --max_restarts times, so the
  // job ends at once and the report says why the restarts were not used.
  const bool restarts_left = attempt < options.max_restarts;
  if (restarts_left && r.restartable && !r.root_cause.will_repeat) {
    spdlog::warn("attempt {} failed: {}; restarting the gang ({} of {} restarts)", attempt,
                 describe(r.root_cause), attempt + 1, options.max_restarts);
    return std::nullopt;
  }
  std::string unused;
  if (restarts_left && r.restartable) {
    unused = "the root cause says it would repeat";
  } else if (restarts_left && r.store_lost) {
    unused = "a lost store ends the job (its host is gone or out of reach)";
  } else if (restarts_left && r.nodes_lost > 0) {
    unused = "fewer nodes remain than --nnodes needs";
  }
  print_failure_report(r, attempt, std::move(unused));
  const int status = r.root_cause.status.shell_status();
  return status == 0 ? 1 : status;
}

void Agent::Impl::print_stop_report(const AttemptResult& r, int attempt) const {
  StopReport report;
  report.program = options.program;
  report.attempt = attempt;
  report.launcher_signal = r.received_signal ? r.received_signal : r.forwarded_signal;
  report.stopped = r.stopped_on_signal;
  const std::string text = format_stop_report(report);
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

// A report that names an error file in the private run directory keeps the directory:
// the path printed must still be there to read after the launcher exits.
void Agent::Impl::keep_error_file(const std::string& error_file) {
  if (!remove_run_dir || error_file.empty()) return;
  const fs::path relative = fs::path(error_file).lexically_relative(job.run_dir);
  if (relative.empty() || *relative.begin() == "..") return;
  remove_run_dir = false;
  spdlog::info("keeping {} for the error file the report names (pass --log_dir to choose the place)",
               job.run_dir.string());
}

void Agent::Impl::print_failure_report(const AttemptResult& r, int attempt, std::string restarts_unused_because) {
  if (!r.root_cause_remote) keep_error_file(r.root_cause.error_file);
  FailureReport report;
  report.restarts_unused_because = std::move(restarts_unused_because);
  report.program = options.program;
  report.attempt = attempt;
  report.max_restarts = options.max_restarts;
  report.root_cause = r.root_cause;
  report.root_cause_remote = r.root_cause_remote;
  report.other_failures = r.other_failures;
  report.stopped_ranks = r.stopped_ranks;
  report.sigkilled_ranks = r.sigkilled_ranks;
  report.found_stopped_ranks = r.found_stopped_ranks;
  report.exited_early_ranks = r.exited_early_ranks;
  report.term_timeout_s = options.term_timeout.count();
  const std::string text = format_failure_report(report);
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

}  // namespace mtrain::launch
