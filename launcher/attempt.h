// One attempt of the gang on this node: spawn this node's workers, supervise them, stop
// them on the first failure anywhere, and say how the attempt ended.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "launcher/failure_report.h"
#include "launcher/options.h"
#include "launcher/orphan_guard.h"
#include "launcher/program.h"
#include "launcher/rendezvous.h"
#include "launcher/signal_pipe.h"

namespace mtrain::launch {

// How long a node waits for the winning node's root cause, on top of --term_timeout
// (the winner publishes it only after stopping its own workers).
inline constexpr Seconds kRootCauseSlack{10.0};

// The job as each of its attempts on this node sees it; the agent sets it up once.
struct Job {
  Job(const LaunchOptions& o, OrphanGuard& g) : options(o), guard(g) {}

  const LaunchOptions& options;
  OrphanGuard& guard;
  SignalPipe* signals = nullptr;
  ProgramCommand command;  // what every worker runs, before the program's arguments
  std::string host;
  std::string run_id;
  std::string token;
  std::filesystem::path run_dir;
  AgentStore store;
  std::string store_address;
  bool set_omp_threads = false;  // OMP_NUM_THREADS is the launcher's to choose
  // --cpu_bind cores: each local rank's CPUs (Note [Binding workers to CPUs]).
  std::vector<std::vector<int>> worker_cpus;
};

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
  std::vector<int> found_stopped_ranks;  // stopped (SIGSTOP) when the teardown began
  std::vector<int> exited_early_ranks;  // status 0 before the teardown started
  // Workers that stopped on a signal after a step; all_stopped when that is every one.
  std::vector<StoppedWorker> stopped_on_signal;
  bool all_stopped = false;
  // Nodes found silent (by this agent, the store's host, or by the host whose notice won):
  // they never leave the store, and a restart expects that many fewer.
  int nodes_lost = 0;
  // Not a failure: nodes waited to join, and the job re-forms with this many nodes
  // without spending a restart (Note [Joining a running job] in rendezvous.cpp); 0 otherwise.
  int reform_nodes = 0;
  // This agent lost the store: nothing more is asked of it (Note [A lost store is not asked again]).
  bool store_lost = false;
};

// Runs round world.attempt; `restarts_used` is what the workers' TORCHELASTIC_RESTART_COUNT says.
AttemptResult run_attempt(const Job& job, const World& world, int restarts_used);

}  // namespace mtrain::launch
