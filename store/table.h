// The server's key-value table and its parked waiters. Single-threaded: only the
// server's poll loop touches it, so it has no locks.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "store/store.h"

namespace mtrain::store_server {

using WaiterId = uint64_t;

// A WAIT whose keys do not all exist is parked until they do (Note [Parked waits] in
// store/table.cpp): every mutation that creates a key reports the waiters that became ready;
// a deletion never un-satisfies a parked wait.
class StoreTable {
 public:
  // `ready` receives the waiters whose last missing key this call created.
  void set(const std::string& key, Bytes value, std::vector<WaiterId>& ready);
  // nullptr when absent. The pointer is valid until the next mutation.
  const Bytes* find(const std::string& key) const;
  // Adds `delta` to the decimal integer stored at `key` (absent = 0) and stores the
  // result as decimal text. Throws InvalidArgument naming the key when the value is not
  // an integer or the sum overflows int64.
  int64_t add(const std::string& key, int64_t delta, std::vector<WaiterId>& ready);
  // See Store::compare_set; an absent key with a non-empty `expected` is left absent and
  // the result is empty.
  Bytes compare_set(const std::string& key, const Bytes& expected, Bytes desired,
                    std::vector<WaiterId>& ready);
  // Indices (into `keys`) of the keys that do not exist.
  std::vector<uint32_t> missing(const std::vector<std::string>& keys) const;
  bool erase(const std::string& key);
  int64_t size() const { return static_cast<int64_t>(values_.size()); }

  // Returns false (and parks nothing) when every key already exists.
  bool park(WaiterId waiter, const std::vector<std::string>& keys);
  void unpark(WaiterId waiter);
  size_t parked() const { return waiters_.size(); }

 private:
  void on_created(const std::string& key, std::vector<WaiterId>& ready);

  std::unordered_map<std::string, Bytes> values_;
  std::unordered_map<WaiterId, std::unordered_set<std::string>> waiters_;  // -> missing keys
  std::unordered_map<std::string, std::vector<WaiterId>> waiters_by_key_;
};

}  // namespace mtrain::store_server
