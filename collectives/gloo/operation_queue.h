// The issue-ordered queue of a Gloo group's operations, run by the group's
// communication thread or, when that is faster, by the thread that waits for one.
//
// Note [Running an operation on the waiting thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Issuing an operation only queues it (Note [Asynchronous collectives]); the
// communication thread runs it and the caller's wait() sleeps until it is done. For a
// caller that issues and waits at once (SyncBatchNorm, metrics, every small
// collective) that is two extra thread wake-ups per operation on each rank, both on
// the critical path: the communication thread's, then the caller's. Each is a chance
// for the scheduler to delay the operation: a few microseconds when a core is free,
// up to a whole scheduler tick (4 ms) when other processes hold the cores
// (measurements in docs/benchmarks.md). So a waiter whose operation is next in line
// while no operation is running takes it off the queue and runs it itself, on its own thread; the communication thread, if it woke up
// meanwhile, finds the queue busy and sleeps again. At most one operation runs at a
// time, in issue order, whichever thread runs it, and the operation's body (with its
// timeout and straggler diagnosis) is the same code either way. Operations that are
// issued and not yet waited on still start on the communication thread, so
// asynchrony (DDP's overlap of bucket all-reduces with backward) is unchanged.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

namespace mtrain {

class Work;

class OperationQueue {
 public:
  struct Task {
    const Work* work;            // identifies the task for run_if_next
    std::function<void()> run;   // runs the operation and settles its Work; never throws
  };

  // Appends a task and wakes the communication thread. false when closed.
  bool push(Task task);

  // Runs the task of `work` on the calling thread if it is the next one and no task is
  // running; returns whether it did.
  bool run_if_next(const Work* work);

  // The communication thread's loop: runs tasks in order until close() was called and
  // every task has run (the peers expect them).
  void run_until_closed();

  // Makes later pushes fail and lets run_until_closed return once the queue is drained.
  void close();

 private:
  // Runs `task` with the lock released; `running_` keeps every other thread out.
  void run_locked(std::unique_lock<std::mutex>& lock, Task task);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool running_ = false;
  bool closed_ = false;
};

}  // namespace mtrain
