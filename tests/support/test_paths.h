// Where tests find the built binaries and the source tree: the build's own directories
// (compiled in), unless MTRAIN_TEST_BIN_DIR or MTRAIN_TEST_SOURCE_DIR name others. The GPU
// kit (scripts/gpu-kit.sh) runs the test binaries from an unpacked folder on a machine
// where the build's paths do not exist.
#pragma once

#include <cstdlib>
#include <string>

namespace mtrain::testing {

inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : std::string(fallback);
}

inline std::string bin_dir() { return env_or("MTRAIN_TEST_BIN_DIR", MTRAIN_BIN_DIR); }
inline std::string source_dir() { return env_or("MTRAIN_TEST_SOURCE_DIR", MTRAIN_SOURCE_DIR); }

}  // namespace mtrain::testing
