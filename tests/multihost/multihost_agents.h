// mtrain-launch agents in the two network namespaces of a NetnsPair, for the multi-host
// tests: the pair (or a skip where namespaces cannot be made), the environment every agent
// shares, and an agent's command line wrapped in `timeout` so that a hang ends the run
// (and the namespaces are removed) well before CTest's limit.
#pragma once

#include <fmt/format.h>
#include <stdlib.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/multihost/netns_pair.h"
#include "tests/support/skip.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/run_process.h"

namespace mtrain::testing {

inline const std::string kTimeoutTool = "/usr/bin/timeout";
// --rdzv_timeout and the trainer's --timeout make the usual hangs fail faster, with a message.
inline constexpr int kAgentLimitSeconds = 90;

inline std::unique_ptr<NetnsPair> netns_pair_or_skip() {
  if (::access(kTimeoutTool.c_str(), X_OK) != 0) skip_test_binary("coreutils `timeout` not found");
  try {
    return std::make_unique<NetnsPair>();
  } catch (const NetnsUnavailable& e) {
    skip_test_binary(e.what());
  }
}

// Same environment for every run: a shared token (several nodes need one), one OpenMP
// thread (Note [Multi-host equivalence] in test_multihost_train.cpp), and none of a
// surrounding launcher's variables, which would otherwise leak into the agents.
inline void prepare_agent_environment() {
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                           "MASTER_PORT", "MTRAIN_STORE_PREFIX", "MTRAIN_RUN_ID", "SPDLOG_LEVEL"}) {
    ::unsetenv(name);
  }
  ::setenv("MTRAIN_STORE_TOKEN", fmt::format("multihost-{}", ::getpid()).c_str(), 1);
  ::setenv("OMP_NUM_THREADS", "1", 1);
}

// What `ip netns exec <ns>` runs for one agent with `launcher_args`.
inline std::vector<std::string> agent_command(const std::vector<std::string>& launcher_args) {
  return concat({"-k", "5", std::to_string(kAgentLimitSeconds), kLauncher}, launcher_args);
}

// One agent inside namespace `ns`, to its end.
inline ProcessResult run_agent(const NetnsPair& net, const std::string& ns,
                               const std::vector<std::string>& launcher_args) {
  return net.run_in(ns, kTimeoutTool, agent_command(launcher_args));
}

}  // namespace mtrain::testing
