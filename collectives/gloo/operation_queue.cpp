#include "collectives/gloo/operation_queue.h"

#include <utility>

namespace mtrain {

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
