#include "launcher/agent.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "collectives/store.h"
#include "core/env.h"
#include "core/error.h"
#include "launcher/failure_report.h"
#include "launcher/log_streams.h"
#include "launcher/rendezvous.h"
#include "launcher/signal_pipe.h"
#include "launcher/worker_env.h"
#include "launcher/worker_process.h"

namespace mtrain::launch {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// How long a node waits for the winning node's root cause, on top of --term_timeout
// (the winner publishes it only after stopping its own workers).
constexpr Seconds kRootCauseSlack{10.0};
// How long leftover processes get to close their ends of the tee pipes at the end of an
// attempt (they were SIGKILLed, so this is only the kernel's cleanup).
constexpr std::chrono::milliseconds kLogDrainTimeout{2000};

// How long the SIGKILLed leftovers of one worker's group get to die and be reaped.
constexpr std::chrono::milliseconds kGroupReapBudget{1000};
// A worker still alive this long after SIGKILL is stuck in the kernel; the log says so.
constexpr std::chrono::seconds kUnkillableWarning{5};

// A terminating signal that arrived while no worker was running.
struct Interrupted {
  int signal;
};

struct LocalWorker {
  int local_rank = 0;
  int global_rank = 0;
  WorkerProcess process;
  fs::path error_file;
  bool sigkilled = false;
  std::optional<StopInfo> stopped;  // Note [Workers stopped on a signal]
};

enum class TeardownReason { kNone, kLocalFailure, kRemoteFailure, kSignal, kStoreLost, kStopIncomplete, kNodeLost };

struct AttemptResult {
  bool succeeded = false;
  Failure root_cause;
  bool root_cause_remote = false;
  bool restartable = false;
  std::optional<int> received_signal;  // a terminating signal sent to this launcher
  bool signal_after_failure = false;    // it came while a failure's teardown ran
  std::optional<int> forwarded_signal;  // the last SIGUSR1/SIGUSR2 passed on to the workers
  std::vector<Failure> other_failures;
  std::vector<int> stopped_ranks;
  std::vector<int> sigkilled_ranks;
  std::vector<int> exited_early_ranks;  // status 0 before the teardown started
  // Workers that stopped on a signal after a step; all_stopped when that is every one.
  std::vector<StoppedWorker> stopped_on_signal;
  bool all_stopped = false;
};

double epoch_seconds(WallClock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

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

// Note [Agent heartbeats] (agent.h): this node's beats, and on the store's host the
// watch over the other nodes' counters.
class Heartbeats {
 public:
  Heartbeats(AttemptChannel& channel, const World& world, bool watch_others, Seconds timeout)
      : channel_(channel),
        node_(world.node_rank),
        watch_others_(watch_others),
        timeout_(std::chrono::duration_cast<Clock::duration>(timeout)),
        period_(std::min<Clock::duration>(std::chrono::seconds(1), timeout_ / 4)),
        seen_(static_cast<size_t>(world.num_nodes), -1),
        changed_(static_cast<size_t>(world.num_nodes), Clock::now()),
        next_(Clock::now()) {}

  Clock::time_point next_due() const { return next_; }

  // When due: beats, and (when watching) returns a sentence about the first node silent
  // for the timeout. Store errors propagate.
  std::optional<std::string> tick(bool watch) {
    const auto now = Clock::now();
    if (now < next_) return std::nullopt;
    next_ = now + period_;
    channel_.heartbeat(node_);
    if (!watch_others_) return std::nullopt;
    const std::vector<int64_t> counts = channel_.heartbeats(static_cast<int>(seen_.size()));
    std::optional<std::string> lost;
    for (size_t n = 0; n < counts.size(); ++n) {
      if (counts[n] != seen_[n]) {
        seen_[n] = counts[n];
        changed_[n] = now;
      } else if (watch && static_cast<int>(n) != node_ && !lost && now - changed_[n] >= timeout_) {
        lost = fmt::format("the launcher on node {} stopped responding: no heartbeat for {:g} s "
                           "(--heartbeat_timeout; its machine or its launcher died, or the network "
                           "to it is down)",
                           n, std::chrono::duration<double>(now - changed_[n]).count());
      }
    }
    return lost;
  }

 private:
  AttemptChannel& channel_;
  const int node_;
  const bool watch_others_;
  const Clock::duration timeout_;
  const Clock::duration period_;
  std::vector<int64_t> seen_;
  std::vector<Clock::time_point> changed_;
  Clock::time_point next_;
};

}  // namespace

struct Agent::Impl {
  Impl(const LaunchOptions& o, OrphanGuard& g) : options(o), guard(g) {}
  ~Impl() {
    if (remove_run_dir) {
      std::error_code ec;
      fs::remove_all(run_dir, ec);
    }
  }

  int run();
  AttemptResult run_attempt(const World& world, int attempt);
  void prepare_run_dir();
  std::vector<LocalWorker> spawn_workers(const World& world, int attempt, LogStreams& logs);
  void check_interrupt();
  void leave_store(int num_nodes, bool hosting);

  const LaunchOptions& options;
  OrphanGuard& guard;
  SignalPipe* signals = nullptr;
  std::string program_path;
  std::string host = local_hostname();
  std::string run_id;
  std::string token;
  fs::path run_dir;
  bool remove_run_dir = false;
  AgentStore store;
  std::string store_address;
  int nodes_lost = 0;  // found by their heartbeats (this agent hosts the store): they never leave it
  bool set_omp_threads = false;  // OMP_NUM_THREADS is the launcher's to choose
  // --cpu_bind cores: each local rank's CPUs (Note [Binding workers to CPUs]).
  std::vector<std::vector<int>> worker_cpus;
};

Agent::Agent(const LaunchOptions& options, OrphanGuard& guard)
    : impl_(std::make_unique<Impl>(options, guard)) {}
Agent::~Agent() = default;
int Agent::run() { return impl_->run(); }

void Agent::Impl::check_interrupt() {
  for (int sig : signals->drain()) {
    if (SignalPipe::is_terminating(sig)) throw Interrupted{sig};
  }
}

void Agent::Impl::prepare_run_dir() {
  if (options.log_dir) {
    run_dir = *options.log_dir;
    std::error_code ec;
    fs::create_directories(run_dir, ec);
    if (ec) {
      throw IoError(fmt::format("--log_dir {}: cannot create it: {}", run_dir.string(),
                                ec.message()));
    }
    return;
  }
  std::string tmpl = (fs::temp_directory_path() / "mtrain-launch-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    throw IoError(fmt::format("cannot create a run directory {}: {}", tmpl, std::strerror(errno)));
  }
  run_dir = tmpl;
  // Error files are read before the launcher exits; redirected logs are the user's and
  // must survive, so the directory is only removed when nothing goes to a file.
  remove_run_dir = !LogStreams::needs_files(options);
  if (!remove_run_dir) {
    spdlog::info("worker logs go to {} (pass --log_dir to choose the place)", run_dir.string());
  }
}

std::vector<LocalWorker> Agent::Impl::spawn_workers(const World& world, int attempt,
                                                    LogStreams& logs) {
  const fs::path attempt_dir = run_dir / fmt::format("attempt_{}", attempt);
  const std::vector<std::string> base_env = current_environment();
  std::vector<LocalWorker> workers;
  workers.reserve(static_cast<size_t>(options.nproc_per_node));
  for (int local = 0; local < options.nproc_per_node; ++local) {
    const int global = world.rank_offset + local;
    const fs::path rank_dir = attempt_dir / std::to_string(global);
    std::error_code ec;
    fs::create_directories(rank_dir, ec);
    if (ec) {
      throw IoError(fmt::format("cannot create {}: {}", rank_dir.string(), ec.message()));
    }
    const fs::path error_file = rank_dir / "error.json";
    fs::remove(error_file, ec);  // a stale record from an earlier run would mislead

    WorkerEnvInputs in;
    in.local_rank = local;
    in.global_rank = global;
    in.local_world_size = options.nproc_per_node;
    in.world_size = world.world_size;
    in.group_rank = world.node_rank;
    in.group_world_size = world.num_nodes;
    in.role = options.role;
    in.master_addr = store.host;
    in.master_port = store.port;
    in.restart_count = attempt;
    in.max_restarts = options.max_restarts;
    in.run_id = run_id;
    in.error_file = error_file.string();
    in.store_token = token;
    in.store_prefix = fmt::format("job/{}/attempt_{}", run_id, attempt);
    const std::vector<int> cpus =
        worker_cpus.empty() ? std::vector<int>{} : worker_cpus[static_cast<size_t>(local)];
    if (set_omp_threads) in.omp_num_threads = cpus.empty() ? 1 : static_cast<int>(cpus.size());

    WorkerSpec spec;
    spec.executable = program_path;
    spec.argv.push_back(options.program);
    spec.argv.insert(spec.argv.end(), options.program_args.begin(), options.program_args.end());
    spec.environment = build_worker_environment(base_env, in);
    const ChildStreams streams = logs.open_for_worker(local, global, rank_dir);
    spec.stdout_fd = streams.stdout_fd;
    spec.stderr_fd = streams.stderr_fd;
    spec.cpus = cpus;
    try {
      workers.push_back(LocalWorker{local, global, WorkerProcess::spawn(spec), error_file, false, std::nullopt});
    } catch (...) {
      logs.close_child_ends(streams);
      for (auto& w : workers) {
        w.process.signal_group(SIGKILL);
        while (w.process.running()) {
          w.process.try_reap();
          if (w.process.running()) usleep(1000);
        }
        guard.release(w.process.pid());
      }
      throw;
    }
    guard.watch(workers.back().process.pid());
    logs.close_child_ends(streams);
  }
  return workers;
}

AttemptResult Agent::Impl::run_attempt(const World& world, int attempt) {
  AttemptChannel channel(*store.client, run_id, attempt);
  LogStreams logs(options);
  std::vector<LocalWorker> workers;
  try {
    workers = spawn_workers(world, attempt, logs);
  } catch (const Error& e) {
    // Every node would fail the same way; make them stop instead of waiting for us.
    try {
      channel.announce_failure(FailureNotice{world.node_rank,
                                             fmt::format("node {}: {}", world.node_rank, e.what()),
                                             false});
    } catch (const Error&) {
    }
    throw;
  }
  logs.start();

  TeardownReason reason = TeardownReason::kNone;
  WallClock::time_point teardown_wall{};
  std::optional<Clock::time_point> kill_deadline;
  std::optional<Clock::time_point> sigkilled_at;  // when the teardown sent SIGKILL
  bool warned_unkillable = false;
  // Set when the first worker stopped on a signal: its peers must follow by then.
  std::optional<Clock::time_point> stop_deadline;
  // The stop of the first worker that stopped during start-up, once its peers were sent
  // SIGTERM for it.
  std::optional<StopInfo> startup_stop_sent;
  std::optional<FailureNotice> winner;  // the attempt's first failure notice
  std::optional<int> received_signal;
  std::optional<int> forwarded_signal;
  std::string store_error;
  const bool watch_store = world.num_nodes > 1;
  auto next_store_check = Clock::now();
  Heartbeats heartbeats(channel, world, store.is_host(), options.heartbeat_timeout);
  std::string lost_node;  // kNodeLost: which, and how long it was silent

  const auto running_count = [&] {
    return std::count_if(workers.begin(), workers.end(),
                         [](const LocalWorker& w) { return w.process.running(); });
  };
  const auto begin_teardown = [&](TeardownReason why, int sig) {
    reason = why;
    teardown_wall = WallClock::now();
    for (auto& w : workers) w.process.signal_group(sig);
    kill_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(options.term_timeout);
  };
  const auto announce = [&](const FailureNotice& notice) {
    try {
      winner = channel.announce_failure(notice);
    } catch (const Error& e) {
      store_error = e.what();
    }
  };
  // The host found a silent node (Note [Agent heartbeats]): the attempt's failure.
  const auto node_lost = [&](std::string what) {
    lost_node = std::move(what);
    ++nodes_lost;
    spdlog::error("stopping the job: {}", lost_node);
    announce(FailureNotice{world.node_rank, lost_node, false});
  };

  while (running_count() > 0) {
    auto timeout = std::max(std::chrono::milliseconds(1),
                            std::chrono::duration_cast<std::chrono::milliseconds>(
                                options.monitor_interval));
    const std::optional<Clock::time_point> beat =
        watch_store ? std::optional(heartbeats.next_due()) : std::nullopt;
    for (const auto& deadline : {kill_deadline, stop_deadline, beat}) {
      if (!deadline) continue;
      timeout = std::min(timeout, std::max(std::chrono::milliseconds(0),
                                           std::chrono::duration_cast<std::chrono::milliseconds>(
                                               *deadline - Clock::now())));
    }
    pollfd pfd{signals->read_fd(), POLLIN, 0};
    ::poll(&pfd, 1, static_cast<int>(timeout.count()));

    for (int sig : signals->drain()) {
      if (SignalPipe::is_forwarded_only(sig)) {
        forwarded_signal = sig;
        spdlog::info("received {}; forwarding it to {} worker(s)", signal_name(sig), running_count());
        for (auto& w : workers) {
          if (w.process.running()) w.process.signal_group(sig);
        }
      } else if (SignalPipe::is_terminating(sig)) {
        if (reason == TeardownReason::kNone) {
          received_signal = sig;
          spdlog::info("received {}; forwarding it to {} worker(s)", signal_name(sig),
                       running_count());
          begin_teardown(TeardownReason::kSignal, sig);
          if (watch_store) {
            announce(FailureNotice{world.node_rank,
                                   fmt::format("the launcher on node {} ({}) received {}",
                                               world.node_rank, host, signal_name(sig)),
                                   false});
          }
        } else if (!received_signal) {
          // A teardown for a failure is under way. The signal still ends the job (no
          // restart follows a signal to a launcher), and the workers get it too.
          received_signal = sig;
          spdlog::info("received {} while stopping the workers; the job ends after this attempt",
                       signal_name(sig));
          for (auto& w : workers) {
            if (w.process.running()) w.process.signal_group(sig);
          }
        } else {
          spdlog::info("received {} after {}; killing the workers now", signal_name(sig),
                       signal_name(*received_signal));
          kill_deadline = Clock::now();
        }
      }
    }

    // Reap the whole pass before starting a teardown: a worker that ended in the same pass
    // as the first failure ended on its own too, and must not be counted among those the
    // teardown stopped (Note [Root cause] compares exit times with the teardown's start).
    std::optional<FailureNotice> local_failure;
    for (auto& w : workers) {
      if (!w.process.try_reap()) continue;
      const ExitStatus& st = *w.process.status();
      spdlog::debug("rank {} (pid {}) ended: {}", w.global_rank, w.process.pid(), st.describe());
      if (!st.signaled && st.code == kStoppedExitCode) {
        if (auto record = read_error_file(w.error_file); record && record->stopped) w.stopped = record->stopped;
      }
      // A peer that died of the SIGTERM sent for a start-up stop (below) had not yet
      // installed its handlers, so it was at its very start: stopped alongside, not a
      // failure of its own.
      if (startup_stop_sent && st.signaled && st.signal == SIGTERM && !w.stopped) {
        w.stopped = *startup_stop_sent;
        w.stopped->signal = "SIGTERM";
      }
      if (w.stopped) {
        if (w.stopped->during_startup) {
          spdlog::info("rank {} stopped on {} during its start-up", w.global_rank, w.stopped->signal);
        } else {
          spdlog::info("rank {} stopped on {} after step {} (epoch {})", w.global_rank, w.stopped->signal,
                       w.stopped->step, w.stopped->epoch);
        }
        if (reason == TeardownReason::kNone && !stop_deadline) {
          stop_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(options.term_timeout);
          // Ranks that stop after a step agree on it among themselves (Note [Agreeing to
          // stop]); a rank gone before its first step leaves its peers waiting for it at
          // the rendezvous, so they get the signal from here (Note [A stop signal during
          // start-up] in trainer/stopping/stop_signals.h).
          if (w.stopped->during_startup) {
            startup_stop_sent = *w.stopped;
            for (auto& peer : workers) {
              if (peer.process.running()) peer.process.signal_group(SIGTERM);
            }
          }
        }
        continue;
      }
      if (!st.success() && reason == TeardownReason::kNone && !local_failure) {
        local_failure = FailureNotice{world.node_rank,
                                      fmt::format("rank {} (node {}, {}): {}", w.global_rank,
                                                  world.node_rank, host, st.describe()),
                                      true};
      }
    }
    if (local_failure) {
      begin_teardown(TeardownReason::kLocalFailure, SIGTERM);
      announce(*local_failure);
    }

    // Beats go on through a teardown, so the host does not take a node that is still
    // stopping its workers for a lost one.
    if (watch_store) {
      try {
        if (auto lost = heartbeats.tick(/*watch=*/reason == TeardownReason::kNone)) {
          begin_teardown(TeardownReason::kNodeLost, SIGTERM);
          node_lost(std::move(*lost));
        }
      } catch (const Error& e) {
        if (reason == TeardownReason::kNone) {
          store_error = e.what();
          begin_teardown(TeardownReason::kStoreLost, SIGTERM);
        }
      }
    }

    if (watch_store && reason == TeardownReason::kNone && Clock::now() >= next_store_check) {
      next_store_check = Clock::now() +
                         std::chrono::duration_cast<Clock::duration>(options.monitor_interval);
      try {
        if (auto notice = channel.failure_notice()) {
          winner = notice;
          spdlog::info("stopping the workers: {}", notice->what);
          begin_teardown(TeardownReason::kRemoteFailure, SIGTERM);
        }
      } catch (const Error& e) {
        store_error = e.what();
        begin_teardown(TeardownReason::kStoreLost, SIGTERM);
      }
    }

    if (stop_deadline && reason == TeardownReason::kNone && Clock::now() >= *stop_deadline) {
      spdlog::warn("{} worker(s) still running --term_timeout {} s after the first stopped on a signal; "
                   "stopping them",
                   running_count(), options.term_timeout.count());
      begin_teardown(TeardownReason::kStopIncomplete, SIGTERM);
      if (watch_store) {
        announce(FailureNotice{world.node_rank,
                               fmt::format("workers on node {} ({}) did not stop with their peers", world.node_rank,
                                           host),
                               false});
      }
    }

    if (kill_deadline && Clock::now() >= *kill_deadline) {
      for (auto& w : workers) {
        if (w.process.running()) {
          w.process.signal_group(SIGKILL);
          w.sigkilled = true;
        }
      }
      kill_deadline.reset();
      sigkilled_at = Clock::now();
    }
    // SIGKILL cannot be ignored, but a process in uninterruptible sleep (a hung NFS
    // mount, a GPU driver) only dies when the kernel call returns: say why we wait.
    if (sigkilled_at && !warned_unkillable && Clock::now() - *sigkilled_at >= kUnkillableWarning) {
      warned_unkillable = true;
      std::vector<std::string> stuck;
      for (const auto& w : workers) {
        if (w.process.running()) stuck.push_back(fmt::format("rank {} (pid {})", w.global_rank, w.process.pid()));
      }
      if (!stuck.empty()) {
        spdlog::warn("{} still running {} s after SIGKILL: stuck in the kernel (uninterruptible sleep, e.g. a "
                     "hung network file system or device driver); waiting for it to exit",
                     fmt::join(stuck, ", "), std::chrono::duration_cast<std::chrono::seconds>(kUnkillableWarning).count());
      }
    }
  }

  // Leaders are reaped; members they left in their groups would be orphans.
  for (auto& w : workers) {
    w.process.kill_and_reap_group(kGroupReapBudget);
    guard.release(w.process.pid());
  }
  logs.finish(kLogDrainTimeout);

  AttemptResult result;
  result.received_signal = received_signal;
  result.forwarded_signal = forwarded_signal;
  for (const auto& w : workers) {
    if (w.stopped) result.stopped_on_signal.push_back({w.global_rank, w.local_rank, world.node_rank, *w.stopped});
  }
  result.all_stopped = result.stopped_on_signal.size() == workers.size();
  if (reason == TeardownReason::kNone) {
    if (!watch_store) {
      result.succeeded = true;
      return result;
    }
    // Note [Gang supervision]: wait for the other nodes, watching for their failures.
    try {
      channel.mark_succeeded();
      while (true) {
        if (channel.all_succeeded(world.num_nodes)) {
          result.succeeded = true;
          return result;
        }
        if (auto notice = channel.failure_notice()) {
          winner = notice;
          reason = TeardownReason::kRemoteFailure;
          break;
        }
        if (auto lost = heartbeats.tick(/*watch=*/true)) {
          node_lost(std::move(*lost));
          reason = TeardownReason::kNodeLost;
          teardown_wall = WallClock::now();
          break;
        }
        pollfd pfd{signals->read_fd(), POLLIN, 0};
        const auto until_beat = std::chrono::duration_cast<std::chrono::milliseconds>(heartbeats.next_due() - Clock::now());
        ::poll(&pfd, 1,
               static_cast<int>(std::clamp<int64_t>(
                   std::min(std::chrono::duration_cast<std::chrono::milliseconds>(options.monitor_interval),
                            until_beat).count(),
                   1, 1000)));
        for (int sig : signals->drain()) {
          if (!SignalPipe::is_terminating(sig)) continue;
          received_signal = sig;
          announce(FailureNotice{world.node_rank,
                                 fmt::format("the launcher on node {} ({}) received {}",
                                             world.node_rank, host, signal_name(sig)),
                                 false});
          reason = TeardownReason::kSignal;
          teardown_wall = WallClock::now();
        }
        if (reason != TeardownReason::kNone) break;
      }
    } catch (const Error& e) {
      store_error = e.what();
      reason = TeardownReason::kStoreLost;
    }
    result.received_signal = received_signal;
    if (reason == TeardownReason::kNone) reason = TeardownReason::kRemoteFailure;
    if (teardown_wall == WallClock::time_point{}) teardown_wall = WallClock::now();
  }

  // Classify every worker (Note [Root cause]).
  std::vector<Failure> failures;
  for (const auto& w : workers) {
    if (w.stopped) continue;  // Note [Workers stopped on a signal]: not a failure
    const ExitStatus& st = *w.process.status();
    const auto record = read_error_file(w.error_file);
    const double exit_time = epoch_seconds(w.process.exit_time());
    const double started_teardown = epoch_seconds(teardown_wall);
    const double when = record && record->timestamp ? *record->timestamp : exit_time;
    const bool failed_on_its_own =
        (!st.success() && exit_time < started_teardown) || (record && when < started_teardown);
    if (failed_on_its_own) {
      Failure f;
      f.global_rank = w.global_rank;
      f.local_rank = w.local_rank;
      f.node_rank = world.node_rank;
      f.host = host;
      f.pid = w.process.pid();
      f.status = st;
      f.timestamp = when;
      f.timestamp_from_error_file = record && record->timestamp.has_value();
      f.sigkilled_by_launcher = w.sigkilled;
      if (record) {
        f.error_file = w.error_file.string();
        f.message = record->message;
        f.traceback = record->traceback;
      }
      failures.push_back(std::move(f));
    } else if (w.process.exit_time() >= teardown_wall && teardown_wall != WallClock::time_point{}) {
      result.stopped_ranks.push_back(w.global_rank);
      if (w.sigkilled) result.sigkilled_ranks.push_back(w.global_rank);
    } else if (st.success()) {
      result.exited_early_ranks.push_back(w.global_rank);
    }
  }

  Failure agent_failure;
  agent_failure.node_rank = world.node_rank;
  agent_failure.host = host;
  agent_failure.timestamp = epoch_seconds(teardown_wall);
  if (reason == TeardownReason::kSignal) {
    agent_failure.status.signaled = true;
    agent_failure.status.signal = *received_signal;
    agent_failure.message = fmt::format("received {}", signal_name(*received_signal));
  } else if (reason == TeardownReason::kStopIncomplete) {
    std::vector<int> stopped, running;
    for (const auto& w : workers) (w.stopped ? stopped : running).push_back(w.global_rank);
    agent_failure.status.code = 1;
    agent_failure.message = fmt::format(
        "rank{} {} stopped on a signal, but rank{} {} did not stop within --term_timeout {} s and had to be "
        "stopped by the launcher (a worker without mtrain-train's stop handling, or one stuck in a collective)",
        stopped.size() == 1 ? "" : "s", fmt::join(stopped, ", "), running.size() == 1 ? "" : "s",
        fmt::join(running, ", "), options.term_timeout.count());
  } else if (reason == TeardownReason::kNodeLost) {
    agent_failure.status.code = 1;
    agent_failure.message = lost_node;
  } else if (reason == TeardownReason::kStoreLost) {
    agent_failure.status.code = 1;
    agent_failure.message =
        fmt::format("lost the rendezvous store at {}: {}", store_address, store_error);
  }

  // This node's candidate root cause.
  Failure local_root = agent_failure;
  if (reason == TeardownReason::kLocalFailure && !failures.empty()) {
    local_root = failures[pick_root_cause(failures)];
  }
  // Without a notice in the store (single node, or announcing failed) this node's view
  // is the only one there is.
  const bool this_node_won = !watch_store || !winner || winner->node_rank == world.node_rank ||
                             reason == TeardownReason::kStoreLost;
  result.restartable = reason == TeardownReason::kLocalFailure;
  result.signal_after_failure = received_signal.has_value() && reason != TeardownReason::kSignal;
  if (this_node_won) {
    result.root_cause = local_root;
    if (watch_store && reason != TeardownReason::kStoreLost) {
      try {
        channel.publish_root_cause(local_root);
      } catch (const std::exception& e) {
        spdlog::warn("could not publish the root cause to the other nodes: {}", e.what());
      }
    }
  } else {
    result.restartable = winner && winner->restartable;
    std::optional<Failure> remote;
    try {
      remote = channel.wait_root_cause(
          std::chrono::duration_cast<Millis>(options.term_timeout + kRootCauseSlack),
          [] {});
    } catch (const Error& e) {
      spdlog::warn("could not read the root cause from the store: {}", e.what());
    }
    if (remote) {
      result.root_cause = *remote;
    } else {
      result.root_cause.node_rank = winner ? winner->node_rank : -1;
      result.root_cause.status.code = 1;
      result.root_cause.timestamp = epoch_seconds(teardown_wall);
      result.root_cause.message =
          fmt::format("{} (its agent never published the details)", winner ? winner->what : "?");
    }
    result.root_cause_remote = true;
  }
  for (const auto& f : failures) {
    const bool is_root = !result.root_cause_remote && f.global_rank == result.root_cause.global_rank;
    if (!is_root) result.other_failures.push_back(f);
  }
  return result;
}

void Agent::Impl::leave_store(int num_nodes, bool hosting) {
  if (num_nodes <= 1) return;
  num_nodes -= nodes_lost;
  const auto noop = [] {};
  try {
    if (hosting) {
      wait_for_others_to_leave(*store.client, run_id, num_nodes - 1,
                               std::chrono::duration_cast<Millis>(options.term_timeout +
                                                                  kRootCauseSlack),
                               noop);
    } else {
      announce_leaving(*store.client, run_id);
    }
  } catch (const Error& e) {
    spdlog::debug("leaving the store: {}", e.what());
  }
}

int Agent::Impl::run() {
  program_path = resolve_program(options.program);

  if (const auto t = env::get("MTRAIN_STORE_TOKEN"); t && !t->empty()) {
    token = *t;
  } else if (options.multi_node()) {
    throw InvalidArgument(
        "MTRAIN_STORE_TOKEN is not set; a job on several nodes needs the same secret token "
        "on every node, e.g. `export MTRAIN_STORE_TOKEN=$(openssl rand -hex 32)` (or a value "
        "from your scheduler) before starting each node's launcher");
  } else {
    token = generate_store_token();
  }
  run_id = options.standalone ? generate_store_token().substr(0, 12) : options.rdzv_id;

  if (options.cpu_bind == CpuBind::kCores) {
    worker_cpus = split_cpus(usable_cpus(), options.nproc_per_node);
    std::string shares;
    for (size_t local = 0; local < worker_cpus.size(); ++local) {
      shares += fmt::format("{}local rank {}: {}", local == 0 ? "" : ", ", local,
                            format_cpu_list(worker_cpus[local]));
    }
    spdlog::info("binding workers to CPUs ({})", shares);
  }
  if (!env::get("OMP_NUM_THREADS") && (options.nproc_per_node > 1 || !worker_cpus.empty())) {
    set_omp_threads = true;
    if (worker_cpus.empty()) {
      spdlog::info("OMP_NUM_THREADS is not set; setting it to 1 for each of the {} workers so "
                   "they do not oversubscribe the CPUs (set it yourself to override)",
                   options.nproc_per_node);
    } else {
      spdlog::info("OMP_NUM_THREADS is not set; setting it to {} for each worker, the size of "
                   "its CPU share (set it yourself to override)", worker_cpus.front().size());
    }
  }
  prepare_run_dir();

  // Note [Worker process hygiene]: orphaned descendants come to us, not to init.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  store = open_agent_store(options, token);
  // The agents' requests are short and never wait for a key (rendezvous polls): a store
  // that does not answer within --heartbeat_timeout is lost (its host died without a
  // connection reset), not slow, and the agent must get back to its workers.
  store.client->set_timeout(std::chrono::duration_cast<Millis>(options.heartbeat_timeout));
  store_address = fmt::format("{}:{}", store.host, store.port);
  signals = &SignalPipe::install();

  int previous_nodes = 0;
  for (int attempt = 0;; ++attempt) {
    World world;
    try {
      world = rendezvous(*store.client, options, run_id, attempt, previous_nodes, store_address,
                         [this] { check_interrupt(); });
    } catch (const Interrupted& i) {
      spdlog::info("received {} while waiting for the other nodes; exiting",
                   signal_name(i.signal));
      return 128 + i.signal;
    }
    previous_nodes = world.num_nodes;
    spdlog::debug("attempt {}: node {} of {}, ranks {}..{} of {}", attempt, world.node_rank,
                  world.num_nodes, world.rank_offset,
                  world.rank_offset + options.nproc_per_node - 1, world.world_size);

    const AttemptResult r = run_attempt(world, attempt);
    // Before anything else: a gang that stopped on a signal is neither a success nor a
    // failure to restart (Note [Workers stopped on a signal]).
    if (r.all_stopped) {
      StopReport report;
      report.program = options.program;
      report.attempt = attempt;
      report.launcher_signal = r.received_signal ? r.received_signal : r.forwarded_signal;
      report.stopped = r.stopped_on_signal;
      const std::string text = format_stop_report(report);
      std::fwrite(text.data(), 1, text.size(), stderr);
      std::fflush(stderr);
      leave_store(world.num_nodes, store.is_host());
      return kStoppedExitCode;
    }
    if (r.succeeded) {
      leave_store(world.num_nodes, store.is_host());
      return 0;
    }
    // A signal to this launcher ends the job here whatever else happened: the user (or
    // the scheduler) asked for it.
    if (r.received_signal) {
      if (r.signal_after_failure) {
        spdlog::warn("attempt {} failed: {}; no restart: {} arrived while the workers were being stopped",
                     attempt, describe(r.root_cause), signal_name(*r.received_signal));
      }
      spdlog::info("stopped {} worker(s) after {}", options.nproc_per_node,
                   signal_name(*r.received_signal));
      leave_store(world.num_nodes, store.is_host());
      return 128 + *r.received_signal;
    }
    if (r.restartable && attempt < options.max_restarts) {
      spdlog::warn("attempt {} failed: {}; restarting the gang ({} of {} restarts)", attempt,
                   describe(r.root_cause), attempt + 1, options.max_restarts);
      continue;
    }
    FailureReport report;
    report.program = options.program;
    report.attempt = attempt;
    report.max_restarts = options.max_restarts;
    report.root_cause = r.root_cause;
    report.root_cause_remote = r.root_cause_remote;
    report.other_failures = r.other_failures;
    report.stopped_ranks = r.stopped_ranks;
    report.sigkilled_ranks = r.sigkilled_ranks;
    report.exited_early_ranks = r.exited_early_ranks;
    report.term_timeout_s = options.term_timeout.count();
    const std::string text = format_failure_report(report);
    std::fwrite(text.data(), 1, text.size(), stderr);
    std::fflush(stderr);
    leave_store(world.num_nodes, store.is_host());
    const int status = r.root_cause.status.shell_status();
    return status == 0 ? 1 : status;
  }
}

}  // namespace mtrain::launch
