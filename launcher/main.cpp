// mtrain-launch: start, supervise and restart a gang of workers, like torchrun.
// Guide: docs/launcher.md.
#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <string>
#include <vector>

#include "core/main_guard.h"
#include "launcher/agent.h"
#include "launcher/options.h"
#include "launcher/orphan_guard.h"

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
    // Before any thread exists (Note [Workers die with the launcher]).
    mtrain::launch::OrphanGuard guard;
    mtrain::launch::Agent agent(parsed.options, guard);
    return agent.run();
  });
}
