#include "collectives/collective_progress.h"

#include <fmt/format.h>

#include <vector>

namespace mtrain {

// Note [Progress publishing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Marking an operation as started is one atomic store in memory; a background thread writes
// `<prefix>/progress/<rank>` to the store only when the value changed, at most every
// kPublishPeriod. DDP issues a handful of collectives per step, so a store round trip per
// operation would cost more than the small all-reduces themselves; a lag of a fraction of a second
// does not matter to a diagnosis made after a timeout of seconds or minutes. The diagnosing rank
// publishes its own value synchronously first.
CollectiveProgress::CollectiveProgress(Store& store, std::string prefix, int rank, int size)
    : store_(store), prefix_(std::move(prefix)), rank_(rank), size_(size) {
  publisher_ = std::thread([this] { publish_loop(); });
}

CollectiveProgress::~CollectiveProgress() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  publisher_.join();
}

std::string CollectiveProgress::key(int rank) const {
  return fmt::format("{}/progress/{}", prefix_, rank);
}

void CollectiveProgress::publish(uint64_t value) {
  store_.set(key(rank_), std::to_string(value));
}

void CollectiveProgress::publish_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kPublishPeriod, [&] { return stop_; });
    if (stop_) break;
    const uint64_t now = started_count_.load(std::memory_order_relaxed);
    if (now == published_) continue;
    lock.unlock();
    try {
      publish(now);
      published_ = now;
    } catch (const std::exception& e) {
      // The store is gone (the launcher stopped?): nothing more to publish. A later
      // diagnosis says so instead of guessing.
      lock.lock();
      publish_error_ = e.what();
      return;
    }
    lock.lock();
  }
}

std::string CollectiveProgress::describe_stragglers(uint64_t seq) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!publish_error_.empty()) {
    return fmt::format("the store could not be reached to find the ranks that never arrived ({})",
                       publish_error_);
  }
  std::vector<int> missing;
  std::vector<std::string> last_ops;
  try {
    publish(started_count_.load(std::memory_order_relaxed));
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      uint64_t count = 0;
      if (store_.check({key(r)})) count = std::stoull(store_.get_string(key(r)));
      if (count <= seq) {
        missing.push_back(r);
        last_ops.push_back(count == 0 ? "none" : fmt::format("#{}", count - 1));
      }
    }
  } catch (const std::exception& e) {
    return fmt::format("the store could not be read to find the ranks that never arrived ({})",
                       e.what());
  }
  if (missing.empty()) {
    return "every rank reached it, so a peer is stuck inside it or the network is too slow for "
           "the timeout";
  }
  if (missing.size() == 1) {
    return fmt::format("rank {} never reached it (its last operation: {})", missing[0], last_ops[0]);
  }
  std::vector<std::string> details;
  for (size_t i = 0; i < missing.size(); ++i) {
    details.push_back(fmt::format("rank {} {}", missing[i], last_ops[i]));
  }
  return fmt::format("ranks {} never reached it (last operations: {})", fmt::join(missing, ", "),
                     fmt::join(details, ", "));
}

}  // namespace mtrain
