#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include "tests/support/skip.h"

namespace {

// Counts failed assertions (and unexpected exceptions) for skip_test_binary.
struct FailedAssertionCounter : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  bool assertionEnded(const Catch::AssertionStats& stats) override {
    if (!stats.assertionResult.isOk()) mtrain::testing::failed_assertions().fetch_add(1);
    return true;
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(FailedAssertionCounter)
