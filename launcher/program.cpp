#include "launcher/program.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/env.h"
#include "core/error.h"

namespace mtrain::launch {

namespace {

bool is_executable_file(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct PathLookup {
  std::optional<std::string> executable;  // the first executable match
  bool found_not_executable = false;      // a match that is not executable came first or alone
};

// `name` in each directory of PATH, in order (an empty entry is the current directory).
PathLookup find_on_path(const std::string& name) {
  const std::string search = env::get("PATH").value_or("/usr/local/bin:/usr/bin:/bin");
  PathLookup found;
  size_t start = 0;
  while (start <= search.size()) {
    const size_t end = std::min(search.find(':', start), search.size());
    const std::string candidate = (end == start ? std::string(".") : search.substr(start, end - start)) + "/" + name;
    if (is_executable_file(candidate)) {
      found.executable = candidate;
      return found;
    }
    if (std::filesystem::exists(candidate)) found.found_not_executable = true;
    start = end + 1;
  }
  return found;
}

// $MTRAIN_PYTHON when set, else torchrun's $PYTHON_EXEC, else the first python3 on PATH.
std::string python_interpreter() {
  for (const char* variable : {"MTRAIN_PYTHON", "PYTHON_EXEC"}) {
    const auto chosen = env::get(variable);
    if (!chosen || chosen->empty()) continue;
    const std::string path =
        chosen->find('/') == std::string::npos ? find_on_path(*chosen).executable.value_or(*chosen) : *chosen;
    if (!is_executable_file(path)) {
      throw InvalidArgument(fmt::format("environment variable {}={}: expected an executable Python "
                                        "interpreter, found none there",
                                        variable, *chosen));
    }
    return path;
  }
  if (auto found = find_on_path("python3").executable) return *found;
  throw InvalidArgument("a Python program needs an interpreter, and python3 is not on PATH: install it, or set "
                        "MTRAIN_PYTHON to one (or pass --no_python to run the program directly)");
}

}  // namespace

// Note [Programs as torchrun runs them]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchrun runs every program under the Python that runs torchrun itself. mtrain-launch
// has no Python of its own and runs native programs too, so it decides by the program:
//   - `train`, `bench`, a path or a command on PATH runs directly, as before;
//   - a program whose name ends in .py runs as `PYTHON script.py args` (torchrun's
//     default), unless --no_python, which runs it directly, by its #! line, as torchrun's
//     --no_python does;
//   - --module runs `PYTHON -m module args`, --run_path `PYTHON -c <runpy.run_path>
//     script args` (torchrun runs it in its own interpreter; here a fresh one per worker
//     does the same for the script). --run_path wins over --no_python, as in torchrun.
// PYTHON is $MTRAIN_PYTHON when set (a path or a name on PATH), else torchrun's
// $PYTHON_EXEC, else PATH's python3, so a virtual environment's python is used when it
// is active; the launcher logs which, once. It runs with -u (unbuffered), as torchrun
// starts it, so that a worker's lines reach the console and the logs as they are printed.
ProgramCommand resolve_command(const LaunchOptions& o) {
  const bool python = o.module || o.run_path || (!o.no_python && ends_with(o.program, ".py"));
  if (o.run_path && o.no_python) {
    spdlog::warn("--no_python is ignored: --run_path runs the program under Python (it takes precedence, as in "
                 "torchrun)");
  }
  if (!python) {
    return {resolve_program(o.program), {o.program}, ""};
  }
  if (!o.module && !std::filesystem::exists(o.program)) {
    throw InvalidArgument(fmt::format("program '{}' does not exist", o.program));
  }
  const std::string interpreter = python_interpreter();
  if (o.module) return {interpreter, {interpreter, "-u", "-m", o.program}, interpreter};
  if (o.run_path) {
    // sys.argv becomes [script, args...], as for `python script args`.
    return {interpreter,
            {interpreter, "-u", "-c",
             "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
             o.program},
            interpreter};
  }
  return {interpreter, {interpreter, "-u", o.program}, interpreter};
}

std::string resolve_program(const std::string& program) {
  namespace fs = std::filesystem;
  std::string path;
  if (program == "train" || program == "bench") {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    if (ec) {
      throw IoError(fmt::format("cannot locate mtrain-launch itself (/proc/self/exe): {}",
                                ec.message()));
    }
    path = (self.parent_path() / ("mtrain-" + program)).string();
    if (!is_executable_file(path)) {
      throw InvalidArgument(fmt::format(
          "program '{}' means {}, which does not exist or is not executable (build the "
          "mtrain-{} target)",
          program, path, program));
    }
    return path;
  }
  if (program.find('/') != std::string::npos) {
    if (!fs::exists(program)) {
      throw InvalidArgument(fmt::format("program '{}' does not exist", program));
    }
    if (!is_executable_file(program)) {
      throw InvalidArgument(
          fmt::format("program '{}' is not an executable file (check its permissions)", program));
    }
    return program;
  }
  const PathLookup found = find_on_path(program);
  if (found.executable) return *found.executable;
  throw InvalidArgument(fmt::format(
      "program '{}' {} on PATH; expected `train`, `bench`, an executable path, or a "
      "command on PATH",
      program, found.found_not_executable ? "is not executable" : "was not found"));
}

}  // namespace mtrain::launch
