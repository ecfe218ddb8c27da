// Runs a program with arguments, waits for it and returns its exit status and what it
// printed, so end-to-end tests drive the real binaries as a user would.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/trainer/temp_dir.h"

extern char** environ;

namespace mtrain::testing {

struct ProcessResult {
  int exit_code = -1;  // -1 when killed by a signal
  std::string out;
  std::string err;

  // Lines of `err` (without the trailing newline of the last one).
  std::vector<std::string> err_lines() const {
    std::vector<std::string> lines;
    size_t start = 0;
    while (start < err.size()) {
      const size_t end = err.find('\n', start);
      lines.push_back(err.substr(start, end == std::string::npos ? std::string::npos : end - start));
      if (end == std::string::npos) break;
      start = end + 1;
    }
    return lines;
  }
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Starts `program` with its stdout and stderr in the files "stdout" and "stderr" of
// `io`: files, not pipes, so a chatty child can never block on a full pipe while we
// wait for it.
inline pid_t spawn_process(const std::string& program, const std::vector<std::string>& args, const TempDir& io) {
  const std::string out_path = io.file("stdout");
  const std::string err_path = io.file("stderr");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(program.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("posix_spawn " + program + ": " + std::strerror(rc));
  return pid;
}

// The exit code of a waitpid status; -1 when a signal ended the process.
inline int exit_code_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

// Waits for `pid` (retrying on EINTR) and returns exit_code_of its status.
inline int wait_for_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
  }
  return exit_code_of(status);
}

inline ProcessResult run_process(const std::string& program, const std::vector<std::string>& args) {
  TempDir io;
  ProcessResult r;
  r.exit_code = wait_for_exit(spawn_process(program, args, io));
  r.out = slurp(io.file("stdout"));
  r.err = slurp(io.file("stderr"));
  return r;
}

}  // namespace mtrain::testing
