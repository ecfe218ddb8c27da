#include "collectives/bootstrap.h"

#include <fmt/format.h>

#include "core/env.h"
#include "core/error.h"

namespace mtrain {

StoreConnection connect_store_from_env(Millis timeout) {
  auto require = [](const char* name) {
    auto v = env::get(name);
    if (!v || v->empty()) {
      throw InvalidArgument(fmt::format(
          "environment variable {} is not set: the store address and token come from the "
          "launcher (mtrain-launch sets MASTER_ADDR, MASTER_PORT and MTRAIN_STORE_TOKEN)",
          name));
    }
    return *v;
  };
  const std::string host = require("MASTER_ADDR");
  require("MASTER_PORT");
  const auto port = static_cast<uint16_t>(*env::get_int("MASTER_PORT", 1, 65535));
  const std::string token = require("MTRAIN_STORE_TOKEN");
  auto tcp = std::make_shared<TcpStore>(host, port, token, timeout, timeout);
  const std::string prefix = env::get("MTRAIN_STORE_PREFIX").value_or("");
  if (prefix.empty()) return {tcp, host, port};
  auto scoped = std::make_shared<PrefixStore>(prefix, *tcp);
  scoped->set_timeout(timeout);
  // The PrefixStore refers to the TcpStore: the handle keeps both alive.
  return {std::shared_ptr<Store>(scoped.get(), [tcp, scoped](Store*) {}), host, port};
}

}  // namespace mtrain
