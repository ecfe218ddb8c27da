// Where each worker's stdout and stderr go, from --redirects, --tee and
// --local_ranks_filter: the console, <attempt dir>/<rank>/<stream>.log, both (tee: each
// console line prefixed "[rank<N>]:"), or nowhere. Files keep every byte; a worker's
// output never delays the launcher's supervision (Note [Worker output routing] in
// log_streams.cpp).
#pragma once

#include <atomic>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "launcher/options.h"

namespace mtrain::launch {

// File descriptors the child should dup2 onto 1 and 2 (-1 = inherit the launcher's).
struct ChildStreams {
  int stdout_fd = -1;
  int stderr_fd = -1;
};

class LogStreams {
 public:
  explicit LogStreams(const LaunchOptions& options);
  ~LogStreams();
  LogStreams(const LogStreams&) = delete;
  LogStreams& operator=(const LogStreams&) = delete;

  // True when the run needs a log directory (something goes to a file).
  static bool needs_files(const LaunchOptions& options);

  // Opens the files and pipes of one worker. `rank_dir` exists already.
  ChildStreams open_for_worker(int local_rank, int global_rank,
                               const std::filesystem::path& rank_dir);
  // Closes the launcher's copies of the child's ends; call after spawning that worker.
  void close_child_ends(const ChildStreams& streams);
  // Starts the pump thread if anything is tee'd. Call after every worker was spawned.
  void start();
  // Waits until every tee'd pipe reached end-of-file (all writers gone), at most
  // `timeout`, flushes partial lines and stops the pump.
  void finish(std::chrono::milliseconds timeout);

 private:
  struct TeeStream {
    int read_fd = -1;
    int file_fd = -1;
    int console_fd = -1;  // 1 or 2
    std::string prefix;   // "[rank3]:"
    std::string partial;  // bytes after the last newline
  };

  enum class Route { kConsole, kFile, kTee, kDiscard };
  Route route_for(int local_rank, int bit) const;
  int open_stream(Route route, int global_rank, int console_fd,
                  const std::filesystem::path& file);
  void pump();
  void pump_loop();
  void drain(TeeStream& s, bool at_eof);

  const LaunchOptions& options_;
  std::vector<TeeStream> tees_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> pump_done_{false};
};

}  // namespace mtrain::launch
