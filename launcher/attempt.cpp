#include "launcher/attempt.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <vector>

#include "store/network_address.h"
#include "core/error.h"
#include "launcher/heartbeats.h"
#include "launcher/log_streams.h"
#include "launcher/signal_pipe.h"
#include "launcher/worker_env.h"
#include "launcher/worker_process.h"

namespace mtrain::launch {
namespace {

// Sleeps until `fd` is readable (a signal arrived) or `timeout_ms` passed. A poll that fails
// other than by an interruption would turn the supervision loop into a busy spin.
void wait_readable(int fd, int timeout_ms) {
  pollfd pfd{fd, POLLIN, 0};
  if (::poll(&pfd, 1, timeout_ms) < 0 && errno != EINTR) {
    throw InternalError(fmt::format("poll on the launcher's signal pipe failed: {}", std::strerror(errno)));
  }
}

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// How long leftover processes get to close their ends of the tee pipes at the end of an
// attempt (they were SIGKILLed, so this is only the kernel's cleanup).
constexpr std::chrono::milliseconds kLogDrainTimeout{2000};

// How long the SIGKILLed leftovers of one worker's group get to die and be reaped.
constexpr std::chrono::milliseconds kGroupReapBudget{1000};
// A worker still alive this long after SIGKILL is stuck in the kernel; the log says so.
constexpr std::chrono::seconds kUnkillableWarning{5};

struct LocalWorker {
  int local_rank = 0;
  int global_rank = 0;
  WorkerProcess process;
  fs::path error_file;
  bool sigkilled = false;             // ignored SIGTERM for --term_timeout
  bool killed_while_stopped = false;  // Note [Stopped workers at teardown]
  std::optional<StopInfo> stopped;  // Note [Workers stopped on a signal]
};

enum class TeardownReason {
  kNone,
  kLocalFailure,
  kRemoteFailure,
  kSignal,
  kStoreLost,
  kStopIncomplete,
  kNodeLost,
  kMembership,  // nodes wait to join: not a failure (Note [Joining a running job] in rendezvous.cpp)
};

double epoch_seconds(WallClock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// One attempt of the gang on this node (Note [Gang supervision]).
class Attempt {
 public:
  Attempt(const Job& job, const World& world, int restarts_used)
      : job_(job),
        options_(job.options),
        world_(world),
        index_(world.attempt),
        restarts_used_(restarts_used),
        watch_store_(world.num_nodes > 1),
        channel_(*job.store.client, job.run_id, world.attempt),
        logs_(job.options) {}

  AttemptResult run();

 private:
  void start_workers();
  void agree_on_worker_master();
  void spawn_workers();
  WorkerSpec worker_spec(int local_rank, int global_rank, const fs::path& error_file,
                         const std::vector<std::string>& base_env) const;
  void kill_spawned_workers();
  // One pass of the supervision loop.
  void wait_for_event();
  void handle_signals();
  void on_terminating_signal(int sig);
  void reap_workers();
  void recognise_stop(LocalWorker& w) const;
  void on_worker_stopped(const LocalWorker& w);
  void watch_store();
  void beat_and_watch_nodes();
  void check_failure_notice();
  void check_waiting_nodes();
  bool elastic() const;
  void enforce_stop_deadline();
  void advance_teardown();
  void warn_if_unkillable();
  // What a pass does to the gang and the store.
  long running_count() const;
  void signal_running(int sig);
  void begin_teardown(TeardownReason why, int sig);
  void announce(const FailureNotice& notice);
  FailureNotice signal_notice(int sig) const;
  void lose_node(std::string what);
  // Once every worker has ended.
  void reap_groups();
  bool all_nodes_succeeded();
  void watch_while_others_finish();
  AttemptResult result(bool succeeded);
  std::vector<Failure> classify_workers(AttemptResult& result) const;
  Failure worker_failure(const LocalWorker& w, const std::optional<ErrorRecord>& record,
                         double when) const;
  Failure agent_failure() const;
  void settle_root_cause(AttemptResult& result, const std::vector<Failure>& failures);
  Failure remote_root_cause();

  const Job& job_;
  const LaunchOptions& options_;
  const World world_;
  const int index_;          // the round: names this attempt's keys and directories
  const int restarts_used_;  // restarts spent before it (re-forms spend none)
  const bool watch_store_;  // several nodes: the store carries failures and heartbeats
  AttemptChannel channel_;
  // The MASTER_ADDR and MASTER_PORT this attempt's workers get (Note [Worker rendezvous
  // for other frameworks]).
  std::string worker_master_addr_;
  uint16_t worker_master_port_ = 0;
  LogStreams logs_;
  std::vector<LocalWorker> workers_;
  std::optional<Heartbeats> heartbeats_;  // with watch_store_, once the workers run

  TeardownReason reason_ = TeardownReason::kNone;
  WallClock::time_point teardown_wall_{};
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> sigkilled_at_;  // when the teardown sent SIGKILL
  bool warned_unkillable_ = false;
  // Set when the first worker stopped on a signal: its peers must follow by then.
  std::optional<Clock::time_point> stop_deadline_;
  // The stop of the first worker that stopped during start-up, once its peers were sent
  // SIGTERM for it.
  std::optional<StopInfo> startup_stop_sent_;
  std::optional<FailureNotice> winner_;  // the attempt's first failure notice
  std::optional<int> received_signal_;
  std::optional<int> forwarded_signal_;
  std::string store_error_;
  Clock::time_point next_store_check_{};
  std::string lost_node_;  // kNodeLost: which, and how long it was silent
  int nodes_lost_ = 0;
};

// Note [Gang supervision]
// ~~~~~~~~~~~~~~~~~~~~~~~
// After the rendezvous (rendezvous.h), each node runs one Attempt:
//   - spawn the local workers, each in its own process group;
//   - poll the signal pipe, so that an exited worker is reaped at once (SIGCHLD), forward
//     signals, and with several nodes beat and look at the attempt's "failed" key every
//     --monitor_interval;
//   - on the first local failure, announce it (compare_set: the attempt's first notice
//     wins), SIGTERM every worker group and SIGKILL what is left after --term_timeout; a
//     notice from another node brings the same teardown without announcing;
//   - the winning node publishes its root cause after its teardown and the others wait
//     for it (bounded), so every node prints the same report and exits with one status.
// A worker's failure restarts the gang on every node, with fresh keys, while restarts
// remain. The agents' own failures (a signal to a launcher, a lost store) end the job
// everywhere: a signal asks the job to stop. A lost node ends it under a static
// rendezvous, where it cannot be replaced; under --nnodes MIN:MAX the others restart
// without it while MIN remain. Nodes waiting to join re-form the job (Note [Joining a
// running job] in rendezvous.cpp): a teardown like a failure's, but no restart spent.
// A node whose workers all succeeded keeps watching until every node's did: a later
// failure elsewhere restarts (or fails) the whole job, this node included. The store's
// host keeps it up until the others have left (Note [Launcher store keys]).

AttemptResult Attempt::run() {
  start_workers();
  while (running_count() > 0) {
    wait_for_event();
    handle_signals();
    reap_workers();
    watch_store();
    enforce_stop_deadline();
    advance_teardown();
  }
  reap_groups();
  const bool succeeded = reason_ == TeardownReason::kNone && all_nodes_succeeded();
  return result(succeeded);
}

// Note [Worker rendezvous for other frameworks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A program written for torchrun (PyTorch's env:// init, `dist.init_process_group`)
// has rank 0 host its own TCPStore at MASTER_ADDR:MASTER_PORT, which must therefore be a
// free port, not the launcher's store (different protocol, and a token). As torchrun does
// without an agent store, node 0's launcher reserves a free port on its own address
// (--local_addr, else the one through which it reaches the launchers' store, which the
// other nodes can reach back) for every attempt, publishes it on the attempt's keys, and
// every node gives it to its workers with TORCHELASTIC_USE_AGENT_STORE=False. mtrain's own workers reach the
// launcher's authenticated store through MTRAIN_STORE_ADDR and MTRAIN_STORE_PORT. The
// port is free when reserved and released at once, as torchrun's is: another process
// could take it before rank 0 binds it, which rank 0 would report.
void Attempt::agree_on_worker_master() {
  if (world_.node_rank == 0) {
    worker_master_addr_ = options_.local_addr ? *options_.local_addr
                                              : route_local_address(job_.store.host, job_.store.port, "mtrain-launch").ip;
    try {
      worker_master_port_ = reserve_free_port(worker_master_addr_);
    } catch (const CommError& e) {
      if (!options_.local_addr) throw;
      throw InvalidArgument(fmt::format("--local_addr {}: expected an address of this node: {}", worker_master_addr_,
                                        e.what()));
    }
    channel_.publish_worker_master(worker_master_addr_, worker_master_port_);
    return;
  }
  const auto timeout = std::chrono::duration_cast<Millis>(options_.rdzv_timeout);
  // Node 0 publishes it right after the rendezvous that every node has just left; if it
  // cannot (a bad --local_addr), it announces a failure, which ends this wait too, as
  // does a stop signal to this launcher.
  const auto check = [this] {
    for (int sig : job_.signals->drain()) {
      if (SignalPipe::is_terminating(sig)) {
        throw CommError(fmt::format("received {} while waiting for node 0's MASTER_ADDR and MASTER_PORT", signal_name(sig)));
      }
    }
    if (const auto notice = channel_.failure_notice()) {
      throw CommError(fmt::format("node {} failed before its workers started: {}", notice->node_rank, notice->what));
    }
  };
  std::tie(worker_master_addr_, worker_master_port_) = channel_.wait_worker_master(timeout, check);
}

void Attempt::start_workers() {
  try {
    agree_on_worker_master();
    spawn_workers();
  } catch (const Error& e) {
    // Every node would fail the same way; make them stop instead of waiting for us.
    try {
      channel_.announce_failure(FailureNotice{world_.node_rank,
                                              fmt::format("node {}: {}", world_.node_rank, e.what()),
                                              false});
    } catch (const Error&) {
    }
    throw;
  }
  logs_.start();
  if (watch_store_) {
    heartbeats_.emplace(channel_, world_, job_.store.is_host(), options_.heartbeat_timeout);
  }
}

void Attempt::spawn_workers() {
  const fs::path attempt_dir = job_.run_dir / fmt::format("attempt_{}", index_);
  const std::vector<std::string> base_env = current_environment();
  workers_.reserve(static_cast<size_t>(options_.nproc_per_node));
  for (int local = 0; local < options_.nproc_per_node; ++local) {
    const int global = world_.rank_offset + local;
    const fs::path rank_dir = attempt_dir / std::to_string(global);
    std::error_code ec;
    fs::create_directories(rank_dir, ec);
    if (ec) {
      throw IoError(fmt::format("cannot create {}: {}", rank_dir.string(), ec.message()));
    }
    const fs::path error_file = rank_dir / "error.json";
    fs::remove(error_file, ec);  // a stale record from an earlier run would mislead

    WorkerSpec spec = worker_spec(local, global, error_file, base_env);
    const ChildStreams streams = logs_.open_for_worker(local, global, rank_dir);
    spec.stdout_fd = streams.stdout_fd;
    spec.stderr_fd = streams.stderr_fd;
    try {
      workers_.push_back(LocalWorker{local, global, WorkerProcess::spawn(spec), error_file, false, false, std::nullopt});
    } catch (...) {
      logs_.close_child_ends(streams);
      kill_spawned_workers();
      throw;
    }
    job_.guard.watch(workers_.back().process.pid());
    logs_.close_child_ends(streams);
  }
}

WorkerSpec Attempt::worker_spec(int local_rank, int global_rank, const fs::path& error_file,
                                const std::vector<std::string>& base_env) const {
  WorkerEnvInputs in;
  in.local_rank = local_rank;
  in.global_rank = global_rank;
  in.local_world_size = options_.nproc_per_node;
  in.world_size = world_.world_size;
  in.group_rank = world_.node_rank;
  in.group_world_size = world_.num_nodes;
  in.role = options_.role;
  in.master_addr = worker_master_addr_;
  in.master_port = worker_master_port_;
  in.store_addr = job_.store.host;
  in.store_port = job_.store.port;
  in.restart_count = restarts_used_;
  in.max_restarts = options_.max_restarts;
  in.run_id = job_.run_id;
  in.error_file = error_file.string();
  in.store_token = job_.token;
  in.store_prefix = fmt::format("job/{}/attempt_{}", job_.run_id, index_);
  const std::vector<int> cpus = job_.worker_cpus.empty()
                                    ? std::vector<int>{}
                                    : job_.worker_cpus[static_cast<size_t>(local_rank)];
  if (job_.set_omp_threads) in.omp_num_threads = cpus.empty() ? 1 : static_cast<int>(cpus.size());

  WorkerSpec spec;
  spec.executable = job_.command.executable;
  spec.argv = job_.command.argv;
  spec.argv.insert(spec.argv.end(), options_.program_args.begin(), options_.program_args.end());
  spec.environment = build_worker_environment(base_env, in);
  spec.cpus = cpus;
  return spec;
}

// A worker failed to start: the ones already running go with it.
void Attempt::kill_spawned_workers() {
  for (auto& w : workers_) {
    w.process.signal_group(SIGKILL);
    while (w.process.running()) {
      w.process.try_reap();
      if (w.process.running()) usleep(1000);
    }
    job_.guard.release(w.process.pid());
  }
}

// Sleeps until a signal arrives (SIGCHLD too: a worker ended), the store is due for a
// look, or a deadline passes.
void Attempt::wait_for_event() {
  auto timeout = std::max(std::chrono::milliseconds(1),
                          std::chrono::duration_cast<std::chrono::milliseconds>(
                              options_.monitor_interval));
  const std::optional<Clock::time_point> beat =
      heartbeats_ ? std::optional(heartbeats_->next_due()) : std::nullopt;
  for (const auto& deadline : {kill_deadline_, stop_deadline_, beat}) {
    if (!deadline) continue;
    timeout = std::min(timeout, std::max(std::chrono::milliseconds(0),
                                         std::chrono::duration_cast<std::chrono::milliseconds>(
                                             *deadline - Clock::now())));
  }
  wait_readable(job_.signals->read_fd(), static_cast<int>(timeout.count()));
}

void Attempt::handle_signals() {
  for (int sig : job_.signals->drain()) {
    if (SignalPipe::is_forwarded_only(sig)) {
      forwarded_signal_ = sig;
      spdlog::info("received {}; forwarding it to {} worker(s)", signal_name(sig), running_count());
      signal_running(sig);
    } else if (SignalPipe::is_terminating(sig)) {
      on_terminating_signal(sig);
    }
  }
}

void Attempt::on_terminating_signal(int sig) {
  if (reason_ == TeardownReason::kNone) {
    received_signal_ = sig;
    spdlog::info("received {}; forwarding it to {} worker(s)", signal_name(sig),
                 running_count());
    begin_teardown(TeardownReason::kSignal, sig);
    if (watch_store_) announce(signal_notice(sig));
  } else if (!received_signal_) {
    // A teardown for a failure is under way. The signal still ends the job (no
    // restart follows a signal to a launcher), and the workers get it too.
    received_signal_ = sig;
    spdlog::info("received {} while stopping the workers; the job ends after this attempt",
                 signal_name(sig));
    signal_running(sig);
  } else {
    spdlog::info("received {} after {}; killing the workers now", signal_name(sig),
                 signal_name(*received_signal_));
    kill_deadline_ = Clock::now();
  }
}

// Reaps the whole pass before starting a teardown: a worker that ended in the same pass
// as the first failure ended on its own too, and must not be counted among those the
// teardown stopped (Note [Root cause] compares exit times with the teardown's start).
void Attempt::reap_workers() {
  std::optional<FailureNotice> local_failure;
  for (auto& w : workers_) {
    if (!w.process.try_reap()) continue;
    const ExitStatus& st = *w.process.status();
    spdlog::debug("rank {} (pid {}) ended: {}", w.global_rank, w.process.pid(), st.describe());
    recognise_stop(w);
    if (w.stopped) {
      on_worker_stopped(w);
      continue;
    }
    if (!st.success() && reason_ == TeardownReason::kNone && !local_failure) {
      local_failure = FailureNotice{world_.node_rank,
                                    fmt::format("rank {} (node {}, {}): {}", w.global_rank,
                                                world_.node_rank, job_.host, st.describe()),
                                    true};
    }
  }
  if (local_failure) {
    begin_teardown(TeardownReason::kLocalFailure, SIGTERM);
    announce(*local_failure);
  }
}

// Note [Workers stopped on a signal]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// mtrain-train stops after the current step on SIGTERM, SIGINT or SIGUSR1, checkpoints,
// leaves a record with a "stopped" object in its error file and exits with
// kStoppedExitCode (75, EX_TEMPFAIL: unfinished, resumable). A worker counts as stopped,
// not failed, only with both: 75 alone could be any program's. A stopped worker starts no
// teardown, because its peers stop after the same step (the ranks agree on it); they get
// --term_timeout before the stragglers are SIGTERMed. When every worker stopped, the agent
// prints the stop report instead of a failure report, does not restart (a signal asked the
// job to stop; the scheduler wants the resources back) and exits 75 too, whether the
// signal reached the launcher or the workers.

// Note [Workers stopped on a signal]: a reaped worker that stopped rather than failed.
void Attempt::recognise_stop(LocalWorker& w) const {
  const ExitStatus& st = *w.process.status();
  if (!st.signaled && st.code == kStoppedExitCode) {
    if (auto record = read_error_file(w.error_file); record && record->stopped) w.stopped = record->stopped;
  }
  // A peer that died of the SIGTERM sent for a start-up stop (on_worker_stopped) had not
  // yet installed its handlers, so it was at its very start: stopped alongside, not a
  // failure of its own.
  if (startup_stop_sent_ && st.signaled && st.signal == SIGTERM && !w.stopped) {
    w.stopped = *startup_stop_sent_;
    w.stopped->signal = "SIGTERM";
  }
}

void Attempt::on_worker_stopped(const LocalWorker& w) {
  if (w.stopped->during_startup) {
    spdlog::info("rank {} stopped on {} during its start-up", w.global_rank, w.stopped->signal);
  } else {
    spdlog::info("rank {} stopped on {} after step {} (epoch {})", w.global_rank, w.stopped->signal,
                 w.stopped->step, w.stopped->epoch);
  }
  if (reason_ != TeardownReason::kNone || stop_deadline_) return;
  stop_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.term_timeout);
  // Ranks that stop after a step agree on it among themselves (Note [Agreeing to
  // stop]); a rank gone before its first step leaves its peers waiting for it at
  // the rendezvous, so they get the signal from here (Note [A stop signal during
  // start-up] in trainer/stopping/stop_signals.cpp).
  if (w.stopped->during_startup) {
    startup_stop_sent_ = *w.stopped;
    signal_running(SIGTERM);
  }
}

void Attempt::watch_store() {
  if (!watch_store_ && !elastic()) return;
  if (heartbeats_) beat_and_watch_nodes();
  check_failure_notice();
}

// --nnodes MIN:MAX with room for another node.
bool Attempt::elastic() const {
  return options_.mode == RendezvousMode::kDynamic && world_.num_nodes < options_.max_nodes;
}

// Beats go on through a teardown, so the host does not take a node that is still
// stopping its workers for a lost one.
//
// Note [A lost store is not asked again]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Once a request to the store has failed (no reply within --heartbeat_timeout, or no
// connection), every later one would wait as long again: a node cut off from the store's
// host took three more such waits (heartbeats through the teardown, which also held back
// the SIGKILL of --term_timeout, then leaving) to end, 15 s instead of 6. So after a lost
// store this agent sends nothing more: no beat, no notice, no root cause, no goodbye.
void Attempt::beat_and_watch_nodes() {
  if (reason_ == TeardownReason::kStoreLost) return;
  try {
    if (auto lost = heartbeats_->tick(/*watch=*/reason_ == TeardownReason::kNone)) {
      begin_teardown(TeardownReason::kNodeLost, SIGTERM);
      lose_node(std::move(*lost));
    }
  } catch (const Error& e) {
    if (reason_ == TeardownReason::kNone) {
      store_error_ = e.what();
      begin_teardown(TeardownReason::kStoreLost, SIGTERM);
    }
  }
}

// Another node's failure, every --monitor_interval.
void Attempt::check_failure_notice() {
  if (reason_ != TeardownReason::kNone || Clock::now() < next_store_check_) return;
  next_store_check_ = Clock::now() +
                      std::chrono::duration_cast<Clock::duration>(options_.monitor_interval);
  try {
    if (auto notice = channel_.failure_notice()) {
      winner_ = notice;
      spdlog::info("stopping the workers: {}", notice->what);
      begin_teardown(notice->reform_nodes > 0 ? TeardownReason::kMembership : TeardownReason::kRemoteFailure, SIGTERM);
      return;
    }
    check_waiting_nodes();
  } catch (const Error& e) {
    store_error_ = e.what();
    begin_teardown(TeardownReason::kStoreLost, SIGTERM);
  }
}

// Note [Joining a running job] (rendezvous.cpp): nodes waiting in the next round.
void Attempt::check_waiting_nodes() {
  if (!elastic()) return;
  const int64_t waiting = channel_.nodes_waiting();
  if (waiting <= 0) return;
  const int nodes = static_cast<int>(std::min<int64_t>(world_.num_nodes + waiting, options_.max_nodes));
  const FailureNotice reform{world_.node_rank,
                             fmt::format("{} node(s) waiting to join; re-forming the job with {} nodes (no restart "
                                         "spent)",
                                         waiting, nodes),
                             true, 0, nodes};
  spdlog::info("stopping the workers after their current step: {}", reform.what);
  begin_teardown(TeardownReason::kMembership, SIGTERM);
  announce(reform);
  // A failure announced first wins: this attempt then ends as that failure.
  if (winner_ && winner_->reform_nodes == 0) reason_ = TeardownReason::kRemoteFailure;
}

// Note [Workers stopped on a signal]: the peers of a stopped worker follow it within
// --term_timeout, or are stopped.
void Attempt::enforce_stop_deadline() {
  if (!stop_deadline_ || reason_ != TeardownReason::kNone || Clock::now() < *stop_deadline_) return;
  spdlog::warn("{} worker(s) still running --term_timeout {} s after the first stopped on a signal; "
               "stopping them",
               running_count(), options_.term_timeout.count());
  begin_teardown(TeardownReason::kStopIncomplete, SIGTERM);
  if (watch_store_) {
    announce(FailureNotice{world_.node_rank,
                           fmt::format("workers on node {} ({}) did not stop with their peers", world_.node_rank,
                                       job_.host),
                           false});
  }
}

// SIGKILL for what outlived --term_timeout.
void Attempt::advance_teardown() {
  if (kill_deadline_ && Clock::now() >= *kill_deadline_) {
    for (auto& w : workers_) {
      if (w.process.running()) {
        w.process.signal_group(SIGKILL);
        w.sigkilled = true;
      }
    }
    kill_deadline_.reset();
    sigkilled_at_ = Clock::now();
  }
  warn_if_unkillable();
}

// SIGKILL cannot be ignored, but a process in uninterruptible sleep (a hung NFS
// mount, a GPU driver) only dies when the kernel call returns: say why we wait.
void Attempt::warn_if_unkillable() {
  if (!sigkilled_at_ || warned_unkillable_ || Clock::now() - *sigkilled_at_ < kUnkillableWarning) return;
  warned_unkillable_ = true;
  std::vector<std::string> stuck;
  for (const auto& w : workers_) {
    if (w.process.running()) stuck.push_back(fmt::format("rank {} (pid {})", w.global_rank, w.process.pid()));
  }
  if (!stuck.empty()) {
    spdlog::warn("{} still running {} s after SIGKILL: stuck in the kernel (uninterruptible sleep, e.g. a "
                 "hung network file system or device driver); waiting for it to exit",
                 fmt::join(stuck, ", "), std::chrono::duration_cast<std::chrono::seconds>(kUnkillableWarning).count());
  }
}

long Attempt::running_count() const {
  return std::count_if(workers_.begin(), workers_.end(),
                       [](const LocalWorker& w) { return w.process.running(); });
}

void Attempt::signal_running(int sig) {
  for (auto& w : workers_) {
    if (w.process.running()) w.process.signal_group(sig);
  }
}

// Note [Stopped workers at teardown]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stopped worker (SIGSTOP, a terminal's ^Z) would hold the teardown's signal pending
// until --term_timeout ran out; continuing it delivers the signal now. After a failure,
// though, a worker found stopped is SIGKILLed instead: continued, it resumes inside the
// step it was stopped in, and a collective whose peers are gone can hold it there for the
// whole --timeout before it sees the SIGTERM (a 2-rank run took --timeout twice over to
// end, test_preemption). Its peers have failed, so it has no step left to finish or
// checkpoint. Only a failure of this node's own workers does so: every other teardown (a
// signal, another node's stop or failure, a membership change, a lost store) still
// continues it, since it may be asked to finish its step cleanly.
void Attempt::begin_teardown(TeardownReason why, int sig) {
  reason_ = why;
  teardown_wall_ = WallClock::now();
  for (auto& w : workers_) {
    if (why == TeardownReason::kLocalFailure && w.process.stopped()) {
      w.process.signal_group(SIGKILL);
      w.killed_while_stopped = true;
      continue;
    }
    w.process.signal_group(sig);
    w.process.signal_group(SIGCONT);
  }
  kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.term_timeout);
}

void Attempt::announce(const FailureNotice& notice) {
  try {
    winner_ = channel_.announce_failure(notice);
  } catch (const Error& e) {
    store_error_ = e.what();
  }
}

FailureNotice Attempt::signal_notice(int sig) const {
  return FailureNotice{world_.node_rank,
                       fmt::format("the launcher on node {} ({}) received {}", world_.node_rank,
                                   job_.host, signal_name(sig)),
                       false};
}

// The host found a silent node (Note [Agent heartbeats]): the attempt's failure. With
// --nnodes MIN:MAX the job restarts without it while MIN nodes remain (and restarts do).
void Attempt::lose_node(std::string what) {
  lost_node_ = std::move(what);
  ++nodes_lost_;
  const bool shrink = options_.mode == RendezvousMode::kDynamic && world_.num_nodes - nodes_lost_ >= options_.min_nodes;
  spdlog::error("stopping the {}: {}", shrink ? "workers" : "job", lost_node_);
  announce(FailureNotice{world_.node_rank, lost_node_, shrink, nodes_lost_, 0});
}

// Leaders are reaped; members they left in their groups would be orphans.
void Attempt::reap_groups() {
  for (auto& w : workers_) {
    w.process.kill_and_reap_group(kGroupReapBudget);
    job_.guard.release(w.process.pid());
  }
  logs_.finish(kLogDrainTimeout);
}

// Note [Gang supervision]: this node's workers all succeeded; so must every node's.
// False when a failure elsewhere, a lost node or store, or a signal ended the wait.
bool Attempt::all_nodes_succeeded() {
  if (!watch_store_) return true;
  try {
    channel_.mark_succeeded();
    while (reason_ == TeardownReason::kNone) {
      if (channel_.all_succeeded(world_.num_nodes)) return true;
      watch_while_others_finish();
    }
  } catch (const Error& e) {
    store_error_ = e.what();
    reason_ = TeardownReason::kStoreLost;
  }
  if (teardown_wall_ == WallClock::time_point{}) teardown_wall_ = WallClock::now();
  return false;
}

// One look at the other nodes' failures, their heartbeats and this launcher's signals.
void Attempt::watch_while_others_finish() {
  if (auto notice = channel_.failure_notice()) {
    winner_ = notice;
    reason_ = TeardownReason::kRemoteFailure;
    return;
  }
  if (auto lost = heartbeats_->tick(/*watch=*/true)) {
    lose_node(std::move(*lost));
    reason_ = TeardownReason::kNodeLost;
    teardown_wall_ = WallClock::now();
    return;
  }
  const auto until_beat = std::chrono::duration_cast<std::chrono::milliseconds>(heartbeats_->next_due() - Clock::now());
  wait_readable(job_.signals->read_fd(),
                static_cast<int>(std::clamp<int64_t>(
                    std::min(std::chrono::duration_cast<std::chrono::milliseconds>(options_.monitor_interval),
                             until_beat).count(),
                    1, 1000)));
  for (int sig : job_.signals->drain()) {
    if (!SignalPipe::is_terminating(sig)) continue;
    received_signal_ = sig;
    announce(signal_notice(sig));
    reason_ = TeardownReason::kSignal;
    teardown_wall_ = WallClock::now();
  }
}

AttemptResult Attempt::result(bool succeeded) {
  AttemptResult result;
  result.received_signal = received_signal_;
  result.forwarded_signal = forwarded_signal_;
  result.nodes_lost = std::max(nodes_lost_, winner_ ? winner_->lost_nodes : 0);
  result.store_lost = reason_ == TeardownReason::kStoreLost;
  if (reason_ == TeardownReason::kMembership && winner_) {
    // Note [Joining a running job]: not a failure; no root cause to settle.
    result.reform_nodes = winner_->reform_nodes;
    return result;
  }
  for (const auto& w : workers_) {
    if (w.stopped) result.stopped_on_signal.push_back({w.global_rank, w.local_rank, world_.node_rank, *w.stopped});
  }
  // Workers that stopped cleanly on the SIGTERM of a teardown for a failure, a lost node or
  // a lost store were stopped by the launcher, not by a signal asking the job to stop.
  const bool for_a_failure = reason_ == TeardownReason::kLocalFailure || reason_ == TeardownReason::kNodeLost ||
                             reason_ == TeardownReason::kStoreLost ||
                             (reason_ == TeardownReason::kRemoteFailure && winner_ &&
                              (winner_->restartable || winner_->lost_nodes > 0));
  result.all_stopped = !for_a_failure && result.stopped_on_signal.size() == workers_.size();
  if (succeeded) {
    result.succeeded = true;
    return result;
  }
  settle_root_cause(result, classify_workers(result));
  return result;
}

// Note [Root cause]: the workers that failed on their own; those the teardown stopped,
// and those that exited 0 before it, go into `result`.
std::vector<Failure> Attempt::classify_workers(AttemptResult& result) const {
  std::vector<Failure> failures;
  const bool torn_down = teardown_wall_ != WallClock::time_point{};
  for (const auto& w : workers_) {
    if (w.stopped) {
      // Note [Workers stopped on a signal]: not a failure. One that stopped on the
      // teardown's SIGTERM (a start-up stop ends the worker at once) was stopped by the
      // launcher, and the report says so.
      if (torn_down && w.process.exit_time() >= teardown_wall_) result.stopped_ranks.push_back(w.global_rank);
      continue;
    }
    const auto record = read_error_file(w.error_file);
    WorkerEnd end;
    end.status = *w.process.status();
    end.exit_time = epoch_seconds(w.process.exit_time());
    if (record) end.error_time = record->timestamp.value_or(end.exit_time);
    end.sigkilled_by_launcher = w.sigkilled || w.killed_while_stopped;
    switch (classify_worker_end(end, torn_down ? epoch_seconds(teardown_wall_) : 0.0)) {
      case WorkerEndKind::kFailedOnItsOwn:
        failures.push_back(worker_failure(w, record, end.error_time.value_or(end.exit_time)));
        break;
      case WorkerEndKind::kStoppedByTeardown:
        result.stopped_ranks.push_back(w.global_rank);
        if (w.sigkilled) result.sigkilled_ranks.push_back(w.global_rank);
        if (w.killed_while_stopped) result.found_stopped_ranks.push_back(w.global_rank);
        break;
      case WorkerEndKind::kExitedEarly:
        result.exited_early_ranks.push_back(w.global_rank);
        break;
      case WorkerEndKind::kUncounted:
        break;
    }
  }
  return failures;
}

Failure Attempt::worker_failure(const LocalWorker& w, const std::optional<ErrorRecord>& record,
                                double when) const {
  Failure f;
  f.global_rank = w.global_rank;
  f.local_rank = w.local_rank;
  f.node_rank = world_.node_rank;
  f.host = job_.host;
  f.pid = w.process.pid();
  f.status = *w.process.status();
  f.timestamp = when;
  f.timestamp_from_error_file = record && record->timestamp.has_value();
  f.sigkilled_by_launcher = w.sigkilled || w.killed_while_stopped;
  if (record) {
    f.error_file = w.error_file.string();
    f.message = record->message;
    f.traceback = record->traceback;
    f.will_repeat = record->will_repeat;
  }
  return f;
}

// The failure of this agent itself, when the teardown was not for a worker's failure.
Failure Attempt::agent_failure() const {
  Failure f;
  f.node_rank = world_.node_rank;
  f.host = job_.host;
  f.timestamp = epoch_seconds(teardown_wall_);
  if (reason_ == TeardownReason::kSignal) {
    f.status.signaled = true;
    f.status.signal = *received_signal_;
    f.message = fmt::format("received {}", signal_name(*received_signal_));
  } else if (reason_ == TeardownReason::kStopIncomplete) {
    std::vector<int> stopped, running;
    for (const auto& w : workers_) (w.stopped ? stopped : running).push_back(w.global_rank);
    f.status.code = 1;
    f.message = fmt::format(
        "rank{} {} stopped on a signal, but rank{} {} did not stop within --term_timeout {} s and had to be "
        "stopped by the launcher (a worker without mtrain-train's stop handling, or one stuck in a collective)",
        stopped.size() == 1 ? "" : "s", fmt::join(stopped, ", "), running.size() == 1 ? "" : "s",
        fmt::join(running, ", "), options_.term_timeout.count());
  } else if (reason_ == TeardownReason::kNodeLost) {
    f.status.code = 1;
    f.message = lost_node_;
  } else if (reason_ == TeardownReason::kStoreLost) {
    f.status.code = 1;
    f.message = fmt::format("lost the rendezvous store at {}: {}", job_.store_address, store_error_);
  }
  return f;
}

// The node whose notice won publishes its root cause; every other node takes that one.
void Attempt::settle_root_cause(AttemptResult& result, const std::vector<Failure>& failures) {
  Failure local_root = reason_ == TeardownReason::kLocalFailure && !failures.empty()
                           ? failures[pick_root_cause(failures)]
                           : agent_failure();
  // Published with it, so every node's report names the same ranks.
  if (local_root.global_rank >= 0) local_root.stopped_peers = result.found_stopped_ranks;
  // Without a notice in the store (single node, or announcing failed) this node's view
  // is the only one there is.
  const bool this_node_won = !watch_store_ || !winner_ || winner_->node_rank == world_.node_rank ||
                             reason_ == TeardownReason::kStoreLost;
  result.restartable = reason_ == TeardownReason::kLocalFailure ||
                       (reason_ == TeardownReason::kNodeLost && winner_ && winner_->restartable);
  result.signal_after_failure = received_signal_.has_value() && reason_ != TeardownReason::kSignal;
  if (this_node_won) {
    result.root_cause = local_root;
    if (watch_store_ && reason_ != TeardownReason::kStoreLost) {
      try {
        channel_.publish_root_cause(local_root);
      } catch (const std::exception& e) {
        spdlog::warn("could not publish the root cause to the other nodes: {}", e.what());
      }
    }
  } else {
    result.restartable = winner_ && winner_->restartable;
    result.root_cause = remote_root_cause();
    result.root_cause_remote = true;
  }
  for (const auto& f : failures) {
    const bool is_root = !result.root_cause_remote && f.global_rank == result.root_cause.global_rank;
    if (!is_root) result.other_failures.push_back(f);
  }
}

// The winning node's root cause from the store, or what its notice said.
Failure Attempt::remote_root_cause() {
  std::optional<Failure> remote;
  try {
    remote = channel_.wait_root_cause(
        std::chrono::duration_cast<Millis>(options_.term_timeout + kRootCauseSlack), [] {});
  } catch (const Error& e) {
    spdlog::warn("could not read the root cause from the store: {}", e.what());
  }
  if (remote) return *remote;
  Failure f;
  f.node_rank = winner_ ? winner_->node_rank : -1;
  f.status.code = 1;
  f.timestamp = epoch_seconds(teardown_wall_);
  f.message = fmt::format("{} (its agent never published the details)", winner_ ? winner_->what : "?");
  return f;
}

}  // namespace

AttemptResult run_attempt(const Job& job, const World& world, int restarts_used) {
  return Attempt(job, world, restarts_used).run();
}

}  // namespace mtrain::launch
