// Skipping a whole test binary: print why and exit with the code CTest maps to
// "skipped" (SKIP_RETURN_CODE 77 in tests/CMakeLists.txt).
#pragma once

#include <cstdio>
#include <cstdlib>

namespace mtrain::testing {

inline constexpr int kSkipExitCode = 77;

[[noreturn]] inline void skip_test_binary(const char* why) {
  std::printf("SKIPPED: %s\n", why);
  std::fflush(stdout);
  std::exit(kSkipExitCode);
}

}  // namespace mtrain::testing
