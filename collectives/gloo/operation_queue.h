// The issue-ordered queue of a Gloo group's operations, run by the group's communication thread
// or by the thread that waits for one (Note [Running an operation on the waiting thread] in
// operation_queue.cpp). At most one task runs at a time, in push order, whichever thread runs it.
// Thread-safe.
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
