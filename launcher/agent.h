// The agent: one per node. Hosts or joins the store, runs the rendezvous, spawns this
// node's workers, supervises them, stops the gang on the first failure anywhere,
// restarts it up to --max_restarts times and prints the failure report.
//
// Note [Gang supervision]
// ~~~~~~~~~~~~~~~~~~~~~~~
// One attempt, on each node:
//   1. rendezvous (rendezvous.h) -> this node's rank offset and the world size;
//   2. spawn the local workers (worker_process.h), each in its own process group;
//   3. loop on poll(signal pipe, monitor_interval): reap exited workers at once, forward
//      signals, and (several nodes) check the attempt's "failed" key in the store;
//   4. on the first local failure: announce it in the store (the first announcement of
//      the attempt wins), SIGTERM every worker group, SIGKILL what is left after
//      --term_timeout, reap everything; on a notice from another node: the same
//      teardown without announcing;
//   5. the winning node publishes its root cause; the others wait for it (bounded), so
//      every node prints the same root cause and exits with the same status;
//   6. if the failure was a worker's and restarts remain, every node goes to attempt
//      k+1 with fresh keys; an agent-level failure (a signal to a launcher, a lost store)
//      ends the job everywhere.
// Note [Agent heartbeats]
// ~~~~~~~~~~~~~~~~~~~~~~~
// An agent that dies without a word (SIGKILL, an OOM kill, a machine or network lost)
// announces no failure, and its workers die with it (PR_SET_PDEATHSIG): without more,
// the other nodes' workers would hang in their next collective until its timeout, and
// a node whose workers had all succeeded would wait for that node's success forever.
// So with several nodes every agent adds 1 to `alive/<node>` about once a second (every
// --heartbeat_timeout / 4 when that is shorter) for as long as it supervises an
// attempt, through teardowns too, and the agent hosting the store reads every node's
// counter as often: a node whose counter has not moved for --heartbeat_timeout (30 s)
// is lost. The host announces it as the attempt's failure, naming the node, and every
// node stops; a lost node cannot rejoin, so there is no restart. The watch is the
// host's alone, one read per node per beat; the host's own death is a lost store,
// which every agent sees when a request fails, and a request that gets no answer for
// --heartbeat_timeout fails (the store client's timeout).
//
// A node whose workers all succeeded still waits, watching the "failed" key, until
// every node's workers succeeded: a later failure elsewhere restarts (or fails) the
// whole job, this node included. The hosting agent keeps the store up until the others
// have left (see Note [Launcher store keys]).
#pragma once

#include <memory>

#include "launcher/options.h"
#include "launcher/orphan_guard.h"

namespace mtrain::launch {

class Agent {
 public:
  Agent(const LaunchOptions& options, OrphanGuard& guard);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Runs the job to the end; returns the launcher's exit status (0, the root cause's
  // exit code, or 128 + signal).
  int run();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mtrain::launch
