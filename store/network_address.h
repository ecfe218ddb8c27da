// Which local address reaches a host: what a rank listens on so that its peers can reach
// it (the Gloo device, rank 0's rendezvous store).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mtrain {

struct LocalAddress {
  std::string ip;  // numeric, e.g. "10.0.0.5" or "::1"
  int family = 0;  // AF_INET or AF_INET6
};

// The address this host uses to reach `host:port`: the route the kernel picks (a UDP
// connect() sends nothing; getsockname() reports the source address). A loopback host
// gives loopback, except this host's own name, which gives an address other hosts can
// reach (Note [Gloo on the master's own name] in network_address.cpp). `who` names the
// caller in errors. Throws CommError when `host` cannot be resolved or routed.
LocalAddress route_local_address(const std::string& host, uint16_t port, const std::string& who);

// An address of interface `name`, or (name empty) of any interface that is up and not
// loopback; IPv4 first, never an IPv6 link-local one (it would need a scope). `seen`,
// when given, collects the names of the interfaces that have addresses.
std::optional<LocalAddress> interface_address(const std::string& name, std::string* seen);

// Where rank 0's store listens and every rank on rank 0's host connects: when
// `master_addr` is this host (loopback, one of its addresses, or its own name), the local
// address that reaches it; otherwise `master_addr` unchanged (Note [The store's address]
// in network_address.cpp).
std::string store_address_for(const std::string& master_addr, uint16_t port);

}  // namespace mtrain
