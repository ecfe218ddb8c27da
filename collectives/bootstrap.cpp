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
          "launcher (mtrain-launch sets MTRAIN_STORE_ADDR, MTRAIN_STORE_PORT and MTRAIN_STORE_TOKEN)",
          name));
    }
    return *v;
  };
  // mtrain-launch names its store in variables of its own (MASTER_ADDR is then the
  // framework's rendezvous, a free port); without them MASTER_ADDR names the store.
  const bool own = env::get("MTRAIN_STORE_ADDR").has_value();
  const char* addr_name = own ? "MTRAIN_STORE_ADDR" : "MASTER_ADDR";
  const char* port_name = own ? "MTRAIN_STORE_PORT" : "MASTER_PORT";
  const std::string host = require(addr_name);
  require(port_name);
  const auto port = static_cast<uint16_t>(*env::get_int(port_name, 1, 65535));
  // An empty token: the launcher runs its store without authentication (a loopback-only
  // dynamic rendezvous without MTRAIN_STORE_TOKEN, docs/launcher.md).
  const std::string token = env::get("MTRAIN_STORE_TOKEN").value_or("");
  auto tcp = std::make_shared<TcpStore>(host, port, token, timeout, timeout);
  const std::string prefix = env::get("MTRAIN_STORE_PREFIX").value_or("");
  if (prefix.empty()) return {tcp, host, port};
  auto scoped = std::make_shared<PrefixStore>(prefix, *tcp);
  scoped->set_timeout(timeout);
  // The PrefixStore refers to the TcpStore: the handle keeps both alive.
  return {std::shared_ptr<Store>(scoped.get(), [tcp, scoped](Store*) {}), host, port};
}

}  // namespace mtrain
