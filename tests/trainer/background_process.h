// A program started in the background, for tests that act on it while it runs (send
// it a signal, wait for a file it writes) and then collect its exit status and output
// as run_process does.
#pragma once

#include <signal.h>
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
      : io_(std::make_unique<TempDir>()), pid_(spawn_process(program, args, *io_)) {}
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
    result_.exit_code = exit_code_of(status);
    pid_ = -1;
    return false;
  }
  // Waits for the exit and returns what run_process would have.
  ProcessResult wait() {
    if (pid_ > 0) {
      result_.exit_code = wait_for_exit(pid_);
      pid_ = -1;
    }
    result_.out = slurp(io_->file("stdout"));
    result_.err = slurp(io_->file("stderr"));
    return result_;
  }

 private:
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
