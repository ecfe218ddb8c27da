// Skipping a whole test binary: print why and exit with the code CTest maps to
// "skipped" (SKIP_RETURN_CODE 77 in tests/CMakeLists.txt).
//
// A binary may run cases that need nothing special (CPU checks in a GPU test file)
// before one that skips; exiting 77 then would hide their failures. So the test main
// (catch_main.cpp) counts failed assertions, and skip_test_binary exits 1 instead of 77
// when any has failed.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace mtrain::testing {

inline constexpr int kSkipExitCode = 77;

inline std::atomic<int>& failed_assertions() {
  static std::atomic<int> count{0};
  return count;
}

[[noreturn]] inline void skip_test_binary(const char* why) {
  if (const int failed = failed_assertions().load(); failed > 0) {
    std::printf("NOT SKIPPED (%s): %d assertion(s) failed before the skip\n", why, failed);
    std::fflush(stdout);
    std::exit(1);
  }
  std::printf("SKIPPED: %s\n", why);
  std::fflush(stdout);
  std::exit(kSkipExitCode);
}

}  // namespace mtrain::testing
