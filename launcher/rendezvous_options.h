// The rendezvous part of the launcher's command line: --rdzv_conf's keys, and which
// rendezvous the flags ask for (static, dynamic or standalone), where its store is and this
// node's rank in it. Called by parse_launch_options (options.cpp) once every flag is read.
#pragma once

#include <string>
#include <vector>

#include "launcher/command_line.h"

namespace mtrain::launch {

// Applies --rdzv_conf's keys to the options (Note [Rendezvous settings from --rdzv_conf]);
// InvalidArgument for an unknown key, a bad value, or one that contradicts a flag given.
void apply_rdzv_conf(CommandLine& line);

// Resolves the rendezvous mode, the store's address and port, the run id and the node rank;
// appends to `ignored` a line for each valid flag the mode overrides. InvalidArgument for
// flags that contradict each other or the mode.
void resolve_rendezvous(CommandLine& line, std::vector<std::string>& ignored);

}  // namespace mtrain::launch
