// The process-wide MPI runtime: the one communication thread that makes every MPI call
// (Note [MPI backend threading]) and the watchdog that enforces operation deadlines
// (Note [MPI timeouts]). Internal to the MPI backend.
#pragma once

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

// Every MPI call goes through this: a failure throws CommError naming the call, the
// file and line, and MPI's own description of the error code.
#define MTRAIN_MPI_CHECK(call) ::mtrain::mpi::check_mpi_result((call), #call, __FILE__, __LINE__)

namespace mtrain::mpi {

void check_mpi_result(int rc, const char* call, const char* file, int line);

using Clock = std::chrono::steady_clock;

// One piece of MPI work for the communication thread.
struct MpiTask {
  std::string description;  // "allreduce #3 of group 'world'", for errors
  std::chrono::milliseconds timeout{0};  // deadline = submission time + timeout
  Clock::time_point deadline;
  std::function<void()> body;  // runs on the communication thread; may throw
  // Called exactly once, from whichever thread settles the task: nullptr on success.
  std::function<void(std::exception_ptr)> finish;
};

class MpiRuntime {
 public:
  // Starts the communication thread and initialises MPI on it at first use; throws
  // CommError when MPI cannot be initialised. Never destroyed: an atexit handler
  // finalises MPI (Note [MPI runtime shutdown]).
  static MpiRuntime& instance();

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }

  // Queues `task` behind every earlier one. After a timeout the task fails at once with
  // a CommError instead (Note [MPI timeouts]).
  void submit(std::shared_ptr<MpiTask> task);

  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

 private:
  struct Entry;
  MpiRuntime();
  ~MpiRuntime() = delete;
  void communication_loop(std::exception_ptr* init_error, std::mutex* init_mu,
                          std::condition_variable* init_cv, bool* init_done);
  void initialise_mpi();
  void watchdog_loop();
  void fail_everything_after_timeout(std::unique_lock<std::mutex>& lock,
                                     const std::shared_ptr<Entry>& expired);
  void settle(const std::shared_ptr<Entry>& entry, std::exception_ptr error);
  void shutdown_at_exit();

  int world_rank_ = 0;
  int world_size_ = 0;
  bool initialised_mpi_here_ = false;

  std::mutex mu_;
  std::condition_variable work_cv_;      // communication thread: queue or stop
  std::condition_variable watchdog_cv_;  // watchdog: new deadline or stop
  std::condition_variable exit_cv_;      // shutdown: communication thread done or broken
  std::deque<std::shared_ptr<Entry>> queue_;
  std::shared_ptr<Entry> running_;
  std::string broken_by_;  // non-empty after a timeout: what timed out
  bool stopping_ = false;
  bool stop_watchdog_ = false;
  bool communication_done_ = false;
  std::thread communication_thread_;
  std::thread watchdog_thread_;
};

}  // namespace mtrain::mpi
