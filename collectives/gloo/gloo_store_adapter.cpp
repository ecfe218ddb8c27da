#include "collectives/gloo/gloo_store_adapter.h"

namespace mtrain {

GlooStoreAdapter::GlooStoreAdapter(mtrain::Store& store, std::string prefix, Millis timeout)
    : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

std::string GlooStoreAdapter::full_key(const std::string& key) const { return prefix_ + "/" + key; }

void GlooStoreAdapter::set(const std::string& key, const std::vector<char>& data) {
  store_.set(full_key(key), Bytes(data.begin(), data.end()));
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  // Store::get waits with the store's own timeout; wait first so the group's applies.
  wait({key});
  const Bytes value = store_.get(full_key(key));
  return std::vector<char>(value.begin(), value.end());
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void GlooStoreAdapter::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(full_key(k));
  store_.wait(full, timeout);
}

}  // namespace mtrain
