// What a worker runs: the program the launcher was given, resolved to an executable and
// the arguments in front of the user's (docs/launcher.md, "Programs").
#pragma once

#include <string>
#include <vector>

#include "launcher/options.h"

namespace mtrain::launch {

struct ProgramCommand {
  std::string executable;         // handed to execve
  std::vector<std::string> argv;  // argv of every worker, before the user's arguments
  std::string interpreter;        // the Python interpreter when one runs the program, else empty
};

// Note [Programs as torchrun runs them] in program.cpp: a .py program runs under Python
// (unless --no_python), --module as `python -m`, --run_path through runpy, anything else
// as resolve_program finds it. The interpreter is $MTRAIN_PYTHON, else PATH's python3.
// Throws InvalidArgument naming what is missing.
ProgramCommand resolve_command(const LaunchOptions& options);

// Resolves a program the way the launcher documents it: "train" -> the sibling
// mtrain-train next to this executable, "bench" -> mtrain-bench, a name with a '/' ->
// that path, anything else -> the first match on PATH. Throws InvalidArgument when the
// result does not exist or is not an executable file.
std::string resolve_program(const std::string& program);

}  // namespace mtrain::launch
