#include <utility>

#include "store/store.h"

namespace mtrain {

// Starts with the base store's timeout so a PrefixStore behaves like its base until
// someone calls set_timeout() on it.
PrefixStore::PrefixStore(std::string prefix, Store& base)
    : prefix_(std::move(prefix)), base_(base) {
  timeout_ = base.timeout();
}

std::string PrefixStore::key(const std::string& k) const { return prefix_ + "/" + k; }

void PrefixStore::set(const std::string& key_in, const Bytes& value) { base_.set(key(key_in), value); }

Bytes PrefixStore::get(const std::string& key_in) {
  // Store::get() has no timeout parameter and uses the base's timeout; when this view's
  // timeout differs, wait under ours first.
  if (timeout() != base_.timeout()) base_.wait({key(key_in)}, timeout());
  return base_.get(key(key_in));
}

int64_t PrefixStore::add(const std::string& key_in, int64_t delta) {
  return base_.add(key(key_in), delta);
}

Bytes PrefixStore::compare_set(const std::string& key_in, const Bytes& expected,
                               const Bytes& desired) {
  return base_.compare_set(key(key_in), expected, desired);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> prefixed;
  prefixed.reserve(keys.size());
  for (const auto& k : keys) prefixed.push_back(key(k));
  return base_.check(prefixed);
}

void PrefixStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::string> prefixed;
  prefixed.reserve(keys.size());
  for (const auto& k : keys) prefixed.push_back(key(k));
  base_.wait(prefixed, timeout);
}

bool PrefixStore::delete_key(const std::string& key_in) { return base_.delete_key(key(key_in)); }

int64_t PrefixStore::num_keys() { return base_.num_keys(); }

}  // namespace mtrain
