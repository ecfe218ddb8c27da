// The launcher's signals, turned into bytes on a pipe that the supervision loop polls.
#pragma once

#include <vector>

namespace mtrain::launch {

class SignalPipe {
 public:
  // Installs the handlers (once per process) and returns the pipe.
  static SignalPipe& install();

  int read_fd() const { return read_fd_; }
  // Signals received since the last call, in arrival order (never blocks).
  std::vector<int> drain();

  static bool is_terminating(int sig);
  static bool is_forwarded_only(int sig);

 private:
  SignalPipe();
  int read_fd_ = -1;
};

}  // namespace mtrain::launch
