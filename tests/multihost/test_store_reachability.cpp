// The hosting agent warns when its store is reachable from this machine only (Note
// [Store address across hosts] in launcher/rendezvous.h); this is the test of how it
// tells. Only numeric addresses and names from /etc/hosts, so no DNS is needed.
#include <catch2/catch.hpp>

#include "launcher/rendezvous.h"

using mtrain::launch::loopback_only_address;

TEST_CASE("loopback addresses are recognised, in IPv4, IPv6 and IPv4-mapped form") {
  CHECK(loopback_only_address("127.0.0.1") == "127.0.0.1");
  // Debian's /etc/hosts gives the machine's own name 127.0.1.1: all of 127/8 is loopback.
  CHECK(loopback_only_address("127.0.1.1") == "127.0.1.1");
  CHECK(loopback_only_address("::1") == "::1");
  CHECK(loopback_only_address("::ffff:127.0.0.1") == "::ffff:127.0.0.1");
}

TEST_CASE("addresses other hosts can reach are not loopback") {
  CHECK_FALSE(loopback_only_address("198.51.100.1").has_value());
  CHECK_FALSE(loopback_only_address("10.0.0.1").has_value());
  CHECK_FALSE(loopback_only_address("128.0.0.1").has_value());
  CHECK_FALSE(loopback_only_address("2001:db8::1").has_value());
  CHECK_FALSE(loopback_only_address("::ffff:10.0.0.1").has_value());
  // The unspecified address listens everywhere, so it is not loopback-only either.
  CHECK_FALSE(loopback_only_address("0.0.0.0").has_value());
}

TEST_CASE("a name is judged by every address it resolves to") {
  // "localhost" is in every /etc/hosts and maps to loopback addresses only.
  const auto localhost = loopback_only_address("localhost");
  REQUIRE(localhost.has_value());
  CHECK((localhost->rfind("127.", 0) == 0 || *localhost == "::1"));
}
