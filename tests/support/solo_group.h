// A real one-rank Gloo process group over an in-process store, for tests that need a
// ProcessGroup without spawning ranks.
#pragma once

#include <memory>

#include "collectives/process_group.h"
#include "store/store.h"

namespace mtrain::testing {

struct SoloGroup {
  TcpStoreServer server{"127.0.0.1", 0, "t"};
  std::shared_ptr<ProcessGroup> group;
  SoloGroup() {
    auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), "t");
    group = create_process_group("gloo", store, 0, 1, Device::cpu());
  }
};

}  // namespace mtrain::testing
