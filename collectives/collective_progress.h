// Which operation each rank of a group last started, published through the store, so a timed-out
// collective can name the ranks that never reached it. started() is one relaxed atomic store, for
// any thread; a background thread publishes (Note [Progress publishing] in
// collective_progress.cpp), so the store may lag by up to kPublishPeriod.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "store/store.h"

namespace mtrain {

class CollectiveProgress {
 public:
  static constexpr Millis kPublishPeriod{200};

  // `store` must outlive this object.
  CollectiveProgress(Store& store, std::string prefix, int rank, int size);
  ~CollectiveProgress();
  CollectiveProgress(const CollectiveProgress&) = delete;
  CollectiveProgress& operator=(const CollectiveProgress&) = delete;

  // This rank has started operation `seq` (the group's sequence number).
  void started(uint64_t seq) { started_count_.store(seq + 1, std::memory_order_relaxed); }

  // "rank 2 never reached it (its last operation: #16)", "ranks 1, 2 never reached it
  // (last operations: rank 1 #16, rank 2 none)", or a sentence saying every rank got
  // there, for operation `seq`. Never throws: a store failure is reported in the text.
  std::string describe_stragglers(uint64_t seq);

 private:
  void publish_loop();
  void publish(uint64_t value);
  std::string key(int rank) const;

  Store& store_;
  const std::string prefix_;
  const int rank_;
  const int size_;
  std::atomic<uint64_t> started_count_{0};  // seq + 1 of the last started op; 0 = none
  uint64_t published_ = 0;                  // publisher thread (and describe) only
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string publish_error_;  // guarded by mu_
  std::thread publisher_;
};

}  // namespace mtrain
