// mtrain-launch: start, supervise and restart a gang of workers, like torchrun.
// Guide: docs/launcher.md.
#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "core/main_guard.h"
#include "launcher/agent.h"
#include "launcher/options.h"
#include "launcher/orphan_guard.h"

namespace {

// The store holds a connection per worker and agent, and Gloo one per peer, so the
// usual soft limit of 1024 open files runs out near a thousand ranks, and the store
// then stops accepting. Raise it towards the hard limit (capped: some libraries size
// tables by it); the workers inherit it.
void raise_open_file_limit() {
  constexpr rlim_t kWanted = 65536;
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur >= kWanted) return;
  files.rlim_cur = std::min(kWanted, files.rlim_max);
  setrlimit(RLIMIT_NOFILE, &files);
}

}  // namespace

int main(int argc, char** argv) {
  return mtrain::run_main("mtrain-launch", [&] {
    // stderr, so that the workers' stdout stays theirs; SPDLOG_LEVEL=debug for detail.
    auto logger = spdlog::stderr_logger_mt("mtrain-launch");
    logger->set_pattern("mtrain-launch: %v");
    spdlog::set_default_logger(logger);
    spdlog::cfg::load_env_levels();

    const std::vector<std::string> args(argv + 1, argv + argc);
    const auto parsed = mtrain::launch::parse_command_line(args);
    if (parsed.help) {
      std::fputs(mtrain::launch::usage().c_str(), stdout);
      return 0;
    }
    for (const std::string& note : parsed.ignored) spdlog::warn("{}", note);
    raise_open_file_limit();
    // Before any thread exists (Note [Workers die with the launcher]).
    mtrain::launch::OrphanGuard guard;
    mtrain::launch::Agent agent(parsed.options, guard);
    return agent.run();
  });
}
