// The process-wide MPI runtime, internal to the MPI backend: the queue that runs every MPI
// operation one at a time, on its communication thread or on the thread waiting for it (Note [MPI
// backend threading] in mpi_runtime.cpp), and the watchdog that enforces operation deadlines
// (Note [MPI timeouts]). All members are thread-safe.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
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

// One piece of MPI work for the runtime's queue.
struct MpiTask {
  const uint64_t id = next_id();  // unique in the process, for run_if_next
  std::string description;  // "allreduce #3 of group 'world'", for errors
  std::chrono::milliseconds timeout{0};
  // Set by the runtime when the task starts running: start + timeout. A task waiting
  // in the queue behind a long one has not started, so it cannot be late.
  Clock::time_point deadline = Clock::time_point::max();
  std::function<void()> body;  // the MPI calls, on whichever thread runs it; may throw
  // Called exactly once, from whichever thread settles the task: nullptr on success.
  std::function<void(std::exception_ptr)> finish;

 private:
  static uint64_t next_id();
};

class MpiRuntime {
 public:
  // Starts the communication thread and initialises MPI on it at first use; throws
  // CommError when MPI cannot be initialised. Never destroyed: an atexit handler
  // finalises MPI (Note [MPI runtime shutdown]).
  static MpiRuntime& instance();

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // MPI_COMM_WORLD's size once a runtime has initialised MPI, else 0. Never creates the
  // runtime, and safe from any thread.
  static int started_world_size();

  // Queues `task` behind every earlier one. After a timeout the task fails at once with
  // a CommError instead (Note [MPI timeouts]).
  void submit(std::shared_ptr<MpiTask> task);

  // Runs the task with this id on the calling thread when it is the next one and
  // nothing is running (Note [MPI operations on the waiting thread]); returns whether
  // it did.
  bool run_if_next(uint64_t task_id);

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
  // Notifies the communication thread unless it is awake or already notified; mu_ held.
  void wake_communication_locked();
  // Takes the queue's first task as the running one; mu_ must be held.
  std::shared_ptr<Entry> take_next_locked();
  // Runs a taken task on the calling thread, then settles it.
  void run(const std::shared_ptr<Entry>& entry);
  void settle(const std::shared_ptr<Entry>& entry, std::exception_ptr error);
  void shutdown_at_exit();

  bool batch_threads_ = true;  // MTRAIN_MPI_THREAD_SCHED
  int world_rank_ = 0;
  int world_size_ = 0;
  bool initialised_mpi_here_ = false;

  std::mutex mu_;
  std::condition_variable work_cv_;      // communication thread: queue or stop
  std::condition_variable watchdog_cv_;  // watchdog: new deadline or stop
  std::condition_variable exit_cv_;      // shutdown: communication thread done or broken
  std::deque<std::shared_ptr<Entry>> queue_;
  std::shared_ptr<Entry> running_;
  // Wake-up bookkeeping (Note [Fewer wake-ups per operation] in mpi_runtime.cpp).
  bool communication_sleeping_ = false;  // the communication thread waits on work_cv_
  bool communication_woken_ = false;     // ...and has been notified since
  Clock::duration shortest_timeout_ = Clock::duration::max();
  Clock::time_point watchdog_wakes_at_ = Clock::time_point::max();
  std::string broken_by_;  // non-empty after a timeout: what timed out
  bool stopping_ = false;
  bool stop_watchdog_ = false;
  bool communication_done_ = false;
  std::thread communication_thread_;
  std::thread watchdog_thread_;
};

}  // namespace mtrain::mpi
