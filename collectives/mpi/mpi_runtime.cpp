#include "collectives/mpi/mpi_runtime.h"

#include <fmt/format.h>

#include <sched.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "core/thread_policy.h"

namespace mtrain::mpi {

void check_mpi_result(int rc, const char* call, const char* file, int line) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) {
    std::snprintf(text, sizeof text, "unknown MPI error code %d", rc);
  }
  throw CommError(fmt::format("{} failed at {}:{}: {}", call, file, line, text));
}

uint64_t MpiTask::next_id() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

struct MpiRuntime::Entry {
  std::shared_ptr<MpiTask> task;
  bool settled = false;             // guarded by MpiRuntime::mu_
  bool on_waiting_thread = false;   // run by run_if_next; guarded by MpiRuntime::mu_
};

namespace {

// MTRAIN_MPI_THREAD_SCHED: 'batch' (the default) or 'normal' for the runtime's own
// threads (Note [MPI operations on the waiting thread]).
bool batch_threads_from_env() {
  return env::get_choice("MTRAIN_MPI_THREAD_SCHED", {"batch", "normal"}) == "batch";
}

std::atomic<int> g_started_world_size{0};

}  // namespace

// Note [MPI runtime shutdown]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The runtime is heap-allocated and never deleted, so that a communication thread
// stuck inside MPI after a timeout never touches a destroyed object while the process
// exits. An atexit handler lets the communication thread run what is queued and call
// MPI_Finalize as its last MPI call (so MPI is never finalised while that thread works),
// then joins it. When an operation timed out, the thread is stuck for good: the
// handler leaves it and MPI unfinalised, and mpirun tears the job down.
MpiRuntime& MpiRuntime::instance() {
  static MpiRuntime* runtime = [] {
    auto* created = new MpiRuntime();
    std::atexit([] { instance().shutdown_at_exit(); });
    return created;
  }();
  return *runtime;
}

MpiRuntime::MpiRuntime() : batch_threads_(batch_threads_from_env()) {
  std::exception_ptr init_error;
  std::mutex init_mu;
  std::condition_variable init_cv;
  bool init_done = false;
  communication_thread_ = std::thread(&MpiRuntime::communication_loop, this, &init_error,
                                      &init_mu, &init_cv, &init_done);
  {
    std::unique_lock<std::mutex> lock(init_mu);
    init_cv.wait(lock, [&] { return init_done; });
  }
  if (init_error) {
    communication_thread_.join();
    std::rethrow_exception(init_error);
  }
  watchdog_thread_ = std::thread(&MpiRuntime::watchdog_loop, this);
}

// Note [MPI backend threading]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Groups only queue work; this process-wide queue runs it one operation at a time, in the order
// the process issued it, across groups too. The communication thread makes MPI_Init_thread,
// MPI_Finalize and every operation's MPI calls, except that a thread waiting for the next
// operation may run it itself (Note [MPI operations on the waiting thread]). Since never two
// threads are inside MPI at once, MPI_THREAD_SERIALIZED is all that is asked for, and every Open
// MPI build provides it. If the program initialised MPI itself before the first group, it must
// have asked for MPI_THREAD_SERIALIZED or more and must not call MPI while groups exist; MPI is
// then left for the program to finalise.
void MpiRuntime::initialise_mpi() {
  int already = 0;
  MTRAIN_MPI_CHECK(MPI_Initialized(&already));
  int provided = MPI_THREAD_SINGLE;
  if (already) {
    MTRAIN_MPI_CHECK(MPI_Query_thread(&provided));
  } else {
    MTRAIN_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided));
    initialised_mpi_here_ = true;
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    throw CommError(fmt::format(
        "the mpi backend needs MPI_THREAD_SERIALIZED ({}) or more, the MPI library "
        "provides thread level {}{}",
        MPI_THREAD_SERIALIZED, provided,
        already ? " (MPI was initialised by the program before the first group)" : ""));
  }
  MTRAIN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
  MTRAIN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size_));
  g_started_world_size.store(world_size_);
}

int MpiRuntime::started_world_size() { return g_started_world_size.load(); }

void MpiRuntime::communication_loop(std::exception_ptr* init_error, std::mutex* init_mu,
                                    std::condition_variable* init_cv, bool* init_done) {
  if (batch_threads_) set_this_thread_policy(SCHED_BATCH, "the MPI runtime");
  {
    std::exception_ptr error;
    try {
      initialise_mpi();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(*init_mu);
    *init_error = error;
    *init_done = true;
    init_cv->notify_all();
    if (error) return;
  }
  for (;;) {
    std::shared_ptr<Entry> entry;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // A task run by a waiting thread keeps this one out until it is done.
      while (running_ || (!stopping_ && queue_.empty())) {
        communication_sleeping_ = true;
        work_cv_.wait(lock);
        communication_sleeping_ = false;
        communication_woken_ = false;
      }
      if (queue_.empty()) break;  // stopping and drained
      entry = take_next_locked();
    }
    run(entry);
  }
  if (initialised_mpi_here_) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
  std::lock_guard<std::mutex> lock(mu_);
  communication_done_ = true;
  exit_cv_.notify_all();
}

void MpiRuntime::submit(std::shared_ptr<MpiTask> task) {
  auto entry = std::make_shared<Entry>();
  entry->task = std::move(task);
  std::string refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_by_.empty() && !stopping_) {
      queue_.push_back(entry);
      wake_communication_locked();
      if (entry->task->timeout < shortest_timeout_) shortest_timeout_ = entry->task->timeout;
      return;
    }
    refused = broken_by_.empty() ? std::string("the process is exiting") : broken_by_;
  }
  settle(entry, std::make_exception_ptr(CommError(
                    fmt::format("mpi {} cannot run: {}", entry->task->description, refused))));
}

std::shared_ptr<MpiRuntime::Entry> MpiRuntime::take_next_locked() {
  std::shared_ptr<Entry> entry = queue_.front();
  queue_.pop_front();
  running_ = entry;
  // Note [MPI timeouts]: the clock starts with the operation, not with its submission.
  entry->task->deadline = Clock::now() + entry->task->timeout;
  if (entry->task->deadline < watchdog_wakes_at_) {
    watchdog_wakes_at_ = entry->task->deadline;
    watchdog_cv_.notify_one();
  }
  return entry;
}

void MpiRuntime::run(const std::shared_ptr<Entry>& entry) {
  std::exception_ptr error;
  try {
    entry->task->body();
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_.reset();
    // The communication thread waits for the running task to end before it takes the
    // next one, or before it finalises MPI.
    if (entry->on_waiting_thread && (stopping_ || !queue_.empty())) wake_communication_locked();
  }
  settle(entry, error);
}

// Note [Fewer wake-ups per operation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A notify that finds its thread asleep costs a futex system call, about 1 us on the
// 2-core VM: as much as a whole 4 KiB all-reduce. When the waiting thread runs each
// operation (Note [MPI operations on the waiting thread]), the communication thread
// woken by one issue usually has not run yet at the next (SCHED_BATCH waits for a free
// core or a tick), so it is notified only once until it runs. The watchdog is notified
// only when a new deadline comes before the time it already sleeps until; when nothing
// is pending it sleeps for the shortest timeout submitted so far, which no later
// deadline can precede, and then looks again.
void MpiRuntime::wake_communication_locked() {
  if (communication_sleeping_ && !communication_woken_) {
    communication_woken_ = true;
    work_cv_.notify_one();
  }
}

// Note [MPI operations on the waiting thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Handing each operation to the communication thread costs two thread wake-ups, and for a caller
// that issues and waits at once (mtrain-bench, SyncBatchNorm, metrics) both lie on the critical
// path, a sizeable part of a small all-reduce (docs/benchmarks.md). So, as in the Gloo backend, a
// waiter whose operation is next in line while nothing runs takes it off the queue and makes the
// MPI call on its own thread. That alone rarely happens: the communication thread, woken by the
// issue and having slept longer, preempts the issuer on its core (mpirun binds each rank to one
// core) and usually takes the operation first. Both of the runtime's threads therefore run under
// SCHED_BATCH, whose wake-ups never preempt a running thread: an issued operation starts on the
// communication thread when a core is free or at the next scheduler tick, and an operation waited
// on at once runs on the waiter with almost never a hand-off. MTRAIN_MPI_THREAD_SCHED=normal gives
// the two threads normal scheduling again.
//
// An MPI call cannot be interrupted, so a waiter running a collective that never completes cannot
// receive its TimeoutError. When the watchdog finds the running operation past its deadline and on
// a waiting thread, it prints the TimeoutError's message and ends the job with MPI_Abort (exit
// status 1), which is what a program must do after an MPI timeout anyway (Note [MPI timeouts]).
// wait(timeout) with a timeout shorter than the group's never runs the operation itself, so it
// always returns by its own timeout.
bool MpiRuntime::run_if_next(uint64_t task_id) {
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_ || queue_.empty() || queue_.front()->task->id != task_id) return false;
    entry = take_next_locked();
    entry->on_waiting_thread = true;
  }
  run(entry);
  return true;
}

void MpiRuntime::settle(const std::shared_ptr<Entry>& entry, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (entry->settled) return;
    entry->settled = true;
  }
  entry->task->finish(std::move(error));
}

void MpiRuntime::watchdog_loop() {
  if (batch_threads_) set_this_thread_policy(SCHED_BATCH, "the MPI runtime");
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_watchdog_) {
    std::shared_ptr<Entry> earliest;
    auto consider = [&](const std::shared_ptr<Entry>& e) {
      if (e && !e->settled && (!earliest || e->task->deadline < earliest->task->deadline)) {
        earliest = e;
      }
    };
    consider(running_);  // queued tasks have no deadline yet
    // Note [Fewer wake-ups per operation]
    if (!earliest) {
      // (A timeout of 0 is refused by ProcessGroup, but only after MPI_Comm_dup was
      // queued with it; sleeping 0 would spin.)
      if (shortest_timeout_ == Clock::duration::max() || shortest_timeout_ <= Clock::duration::zero()) {
        watchdog_wakes_at_ = Clock::time_point::max();
        watchdog_cv_.wait(lock);
      } else {
        watchdog_wakes_at_ = Clock::now() + shortest_timeout_;
        watchdog_cv_.wait_until(lock, watchdog_wakes_at_);
      }
      continue;
    }
    if (Clock::now() < earliest->task->deadline) {
      watchdog_wakes_at_ = earliest->task->deadline;
      watchdog_cv_.wait_until(lock, watchdog_wakes_at_);
      continue;
    }
    fail_everything_after_timeout(lock, earliest);
  }
}

// Note [MPI timeouts]
// ~~~~~~~~~~~~~~~~~~~
// An MPI collective cannot be cancelled. The watchdog fails the Work of an operation that runs
// longer than its group's timeout (counted from when it starts: one queued behind a slow operation
// of another group is not late) with a TimeoutError naming the operation, group and sequence
// number (MPI cannot tell which ranks never arrived), and fails every other queued or later
// operation with a CommError: the thread running it stays blocked inside MPI forever and the
// collective order is broken (when that thread is the waiter itself, see Note [MPI operations on
// the waiting thread]). The process must then exit; at exit MPI is not finalised (that would
// hang), so mpirun sees a rank leave without MPI_Finalize and tears the job down. abort_mpi_job()
// (MPI_Abort) ends every rank at once and is the quickest way out.
// Called with mu_ held; releases it while settling (finish callbacks take Work locks).
void MpiRuntime::fail_everything_after_timeout(std::unique_lock<std::mutex>& lock,
                                               const std::shared_ptr<Entry>& expired) {
  const std::string& what = expired->task->description;
  broken_by_ = fmt::format(
      "an earlier operation ({}) timed out and is still blocked inside MPI; MPI collectives "
      "cannot be cancelled, so this process must exit (abort_mpi_job ends the whole job)",
      what);
  const std::string reason = broken_by_;
  std::vector<std::shared_ptr<Entry>> others(queue_.begin(), queue_.end());
  if (running_ && running_ != expired) others.push_back(running_);
  // A waiting thread inside MPI cannot receive an error (Note [MPI operations on the
  // waiting thread]).
  const std::shared_ptr<Entry> stuck_waiter =
      running_ && running_->on_waiting_thread ? running_ : nullptr;
  queue_.clear();
  // The communication thread may be blocked in an operation whose peers are still
  // coming; whether or not it ever returns, the group's collective order is broken.
  exit_cv_.notify_all();
  lock.unlock();
  const std::string timed_out = fmt::format(
      "mpi {} did not complete within {} ms (the mpi backend cannot tell which ranks never "
      "arrived)",
      what, expired->task->timeout.count());
  settle(expired, std::make_exception_ptr(TimeoutError(fmt::format(
                      "{}; MPI collectives cannot be cancelled, so this process must exit: "
                      "call mtrain::abort_mpi_job (MPI_Abort) to end every rank",
                      timed_out))));
  for (const auto& e : others) {
    settle(e, std::make_exception_ptr(CommError(
                  fmt::format("mpi {} cannot complete: {}", e->task->description, reason))));
  }
  if (stuck_waiter) {
    std::fprintf(stderr,
                 "mtrain: error: %s; the thread waiting for %s runs it inside MPI, where it "
                 "cannot be interrupted, so the job ends here with MPI_Abort\n",
                 timed_out.c_str(), stuck_waiter->task->description.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);  // from this thread on purpose, like abort_mpi_job
    std::_Exit(1);
  }
  lock.lock();
}

void MpiRuntime::shutdown_at_exit() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  work_cv_.notify_all();
  exit_cv_.wait(lock, [&] { return communication_done_ || !broken_by_.empty(); });
  const bool communication_finished = communication_done_;
  stop_watchdog_ = true;
  watchdog_cv_.notify_all();
  lock.unlock();
  watchdog_thread_.join();
  if (communication_finished) {
    communication_thread_.join();
  } else {
    communication_thread_.detach();  // stuck inside MPI; see Note [MPI runtime shutdown]
  }
}

}  // namespace mtrain::mpi
