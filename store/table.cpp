#include "store/table.h"

#include <algorithm>
#include <charconv>

#include "store/wire.h"
#include "core/error.h"

namespace mtrain::store_server {

namespace {

// Counters are stored as decimal text (as c10d does) so that get() of a counter reads
// naturally and set(k, "5") followed by add(k, 1) works.
bool parse_counter(const Bytes& value, int64_t& out) {
  const char* first = reinterpret_cast<const char*>(value.data());
  const char* last = first + value.size();
  if (first == last) return false;
  const auto [end, ec] = std::from_chars(first, last, out);
  return ec == std::errc() && end == last;
}

std::string preview(const Bytes& value) {
  constexpr size_t kShown = 32;
  std::string shown(value.begin(), value.begin() + std::min(value.size(), kShown));
  return store_wire::quote_key(shown) +
         (value.size() > kShown ? fmt::format(" ({} bytes in all)", value.size()) : "");
}

}  // namespace

void StoreTable::set(const std::string& key, Bytes value, std::vector<WaiterId>& ready) {
  const bool created = values_.insert_or_assign(key, std::move(value)).second;
  if (created) on_created(key, ready);
}

const Bytes* StoreTable::find(const std::string& key) const {
  const auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

int64_t StoreTable::add(const std::string& key, int64_t delta, std::vector<WaiterId>& ready) {
  int64_t current = 0;
  const auto it = values_.find(key);
  if (it != values_.end() && !parse_counter(it->second, current)) {
    throw InvalidArgument(fmt::format(
        "store add on key {}: expected its value to be a decimal integer, found {}",
        store_wire::quote_key(key), preview(it->second)));
  }
  int64_t sum = 0;
  if (__builtin_add_overflow(current, delta, &sum)) {
    throw InvalidArgument(fmt::format("store add on key {}: {} + {} overflows int64",
                                      store_wire::quote_key(key), current, delta));
  }
  const std::string text = std::to_string(sum);
  set(key, Bytes(text.begin(), text.end()), ready);
  return sum;
}

Bytes StoreTable::compare_set(const std::string& key, const Bytes& expected, Bytes desired,
                              std::vector<WaiterId>& ready) {
  const auto it = values_.find(key);
  if (it == values_.end()) {
    if (!expected.empty()) return {};
    set(key, desired, ready);
    return desired;
  }
  if (it->second == expected) it->second = std::move(desired);
  return it->second;
}

std::vector<uint32_t> StoreTable::missing(const std::vector<std::string>& keys) const {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!values_.contains(keys[i])) out.push_back(static_cast<uint32_t>(i));
  }
  return out;
}

bool StoreTable::erase(const std::string& key) { return values_.erase(key) > 0; }

// Note [Parked waits]
// ~~~~~~~~~~~~~~~~~~~
// A WAIT whose keys do not all exist is parked: the table remembers which keys the waiter still
// misses and, per key, which waiters miss it. Every mutation that creates a key (set, add,
// compare_set on an absent key) reports the waiters that became ready so the server can answer
// them. A waiter is forgotten when it becomes ready or when its connection closes (unpark). A key
// counts as found once it has been created after the wait was parked, even if it is deleted again
// before the other keys appear: a deletion never un-satisfies a parked wait.
bool StoreTable::park(WaiterId waiter, const std::vector<std::string>& keys) {
  std::unordered_set<std::string> absent;
  for (const auto& k : keys) {
    if (!values_.contains(k)) absent.insert(k);
  }
  if (absent.empty()) return false;
  for (const auto& k : absent) waiters_by_key_[k].push_back(waiter);
  waiters_[waiter] = std::move(absent);
  return true;
}

void StoreTable::unpark(WaiterId waiter) {
  const auto it = waiters_.find(waiter);
  if (it == waiters_.end()) return;
  for (const auto& k : it->second) {
    auto by_key = waiters_by_key_.find(k);
    if (by_key == waiters_by_key_.end()) continue;
    std::erase(by_key->second, waiter);
    if (by_key->second.empty()) waiters_by_key_.erase(by_key);
  }
  waiters_.erase(it);
}

void StoreTable::on_created(const std::string& key, std::vector<WaiterId>& ready) {
  const auto by_key = waiters_by_key_.find(key);
  if (by_key == waiters_by_key_.end()) return;
  const std::vector<WaiterId> waiting = std::move(by_key->second);
  waiters_by_key_.erase(by_key);
  for (const WaiterId w : waiting) {
    const auto it = waiters_.find(w);
    if (it == waiters_.end()) continue;
    it->second.erase(key);
    if (it->second.empty()) {
      waiters_.erase(it);
      ready.push_back(w);
    }
  }
}

}  // namespace mtrain::store_server
