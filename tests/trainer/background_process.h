// A program started in the background, for tests that act on it while it runs (send
// it a signal, wait for a file it writes) and then collect its exit status and output
// as run_process does.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"

namespace mtrain::testing {

class BackgroundProcess {
 public:
  BackgroundProcess(const std::string& program, const std::vector<std::string>& args)
      : io_(std::make_unique<TempDir>()) {
    const std::string out_path = io_->file("stdout");
    const std::string err_path = io_->file("stderr");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(program.c_str()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, program.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw std::runtime_error("posix_spawn " + program + ": " + std::strerror(rc));
  }
  // A test that failed half-way must not leave the program running.
  ~BackgroundProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  BackgroundProcess(const BackgroundProcess&) = delete;
  BackgroundProcess& operator=(const BackgroundProcess&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) const {
    if (::kill(pid_, sig) != 0) throw std::runtime_error(std::string("kill: ") + std::strerror(errno));
  }
  // True when it is still running (not yet reaped).
  bool running() {
    if (pid_ <= 0) return false;
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == 0) return true;
    finish(status);
    return false;
  }
  // Waits for the exit and returns what run_process would have.
  ProcessResult wait() {
    if (pid_ > 0) {
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0) {
        if (errno != EINTR) throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
      }
      finish(status);
    }
    result_.out = slurp(io_->file("stdout"));
    result_.err = slurp(io_->file("stderr"));
    return result_;
  }

 private:
  void finish(int status) {
    result_.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    pid_ = -1;
  }

  std::unique_ptr<TempDir> io_;
  pid_t pid_ = -1;
  ProcessResult result_;
};

// Polls `ready` every 20 ms until it holds or `limit` passes; returns whether it held.
inline bool wait_until(const std::function<bool()>& ready, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ready();
}

}  // namespace mtrain::testing
