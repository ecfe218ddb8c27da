#include "collectives/gloo/operation_queue.h"

#include <utility>

namespace mtrain {

// Note [Running an operation on the waiting thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Issuing an operation only queues it (Note [Asynchronous collectives]); the communication thread
// runs it and the caller's wait() sleeps until it is done. For a caller that issues and waits at
// once (SyncBatchNorm, metrics, every small collective) that is two extra thread wake-ups per
// operation on each rank, both on the critical path: the communication thread's, then the
// caller's. Each is a chance for the scheduler to delay the operation: a few microseconds when a
// core is free, up to a whole scheduler tick when other processes hold the cores (measurements in
// docs/benchmarks.md). So a waiter whose operation is next in line while no operation is running
// takes it off the queue and runs it itself, on its own thread; the communication thread, if it
// woke up meanwhile, finds the queue busy and sleeps again. At most one operation runs at a time,
// in issue order, whichever thread runs it, and the operation's body (with its timeout and
// straggler diagnosis) is the same code either way. Operations that are issued and not yet waited
// on still start on the communication thread, so asynchrony (DDP's overlap of bucket all-reduces
// with backward) is unchanged.
bool OperationQueue::push(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();  // only the communication thread sleeps on cv_
  return true;
}

bool OperationQueue::run_if_next(const Work* work) {
  std::unique_lock<std::mutex> lock(mu_);
  if (running_ || queue_.empty() || queue_.front().work != work) return false;
  Task task = std::move(queue_.front());
  queue_.pop_front();
  run_locked(lock, std::move(task));
  // Later operations were left to the communication thread, which slept while this ran.
  const bool more = !queue_.empty() || closed_;
  lock.unlock();
  if (more) cv_.notify_one();
  return true;
}

void OperationQueue::run_until_closed() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return !running_ && (closed_ || !queue_.empty()); });
    if (queue_.empty()) return;  // closed and drained
    Task task = std::move(queue_.front());
    queue_.pop_front();
    run_locked(lock, std::move(task));
  }
}

void OperationQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_one();
}

void OperationQueue::run_locked(std::unique_lock<std::mutex>& lock, Task task) {
  running_ = true;
  lock.unlock();
  task.run();
  lock.lock();
  running_ = false;
}

}  // namespace mtrain
