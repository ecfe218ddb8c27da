// Lets Gloo's rendezvous (Context::connectFullMesh) run over the mtrain store.
#pragma once

#include <gloo/rendezvous/store.h>

#include <string>
#include <vector>

#include "store/store.h"

namespace mtrain {

// Every key gets `prefix + "/"` in front, so each group (and each restart) rendezvous
// in its own namespace. Waits that run out throw mtrain::TimeoutError naming the keys;
// Gloo lets it propagate out of connectFullMesh.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(mtrain::Store& store, std::string prefix, Millis timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  std::string full_key(const std::string& key) const;
  mtrain::Store& store_;  // qualified: inside this class "Store" names gloo's base
  const std::string prefix_;
  const Millis timeout_;
};

}  // namespace mtrain
