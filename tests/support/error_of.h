// The message of the exception of type E that fn throws; fails the test when it throws
// nothing (or something else, which then propagates).
#pragma once

#include <catch2/catch.hpp>

#include <functional>
#include <string>

namespace mtrain::testing {

template <class E>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception of the given type");
  return {};
}

}  // namespace mtrain::testing
