// The agent: one per node. Hosts or joins the store, runs the rendezvous, spawns this
// node's workers, supervises them, stops the gang on the first failure anywhere,
// restarts it up to --max_restarts times and prints the failure report.
//
// Every node of a job prints the same root cause and exits with the same status. Only a
// worker's failure restarts the gang; a signal to any launcher, a lost store or a lost
// node ends the job on every node (Note [Gang supervision] in attempt.cpp).
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
