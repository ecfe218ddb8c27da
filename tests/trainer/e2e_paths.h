// What the end-to-end tests run: the built binaries, the shipped data slice, and a
// helper to assemble their command lines.
#pragma once

#include <string>
#include <vector>

#include "tests/support/test_paths.h"

namespace mtrain::testing {

inline const std::string kLauncher = bin_dir() + "/mtrain-launch";
inline const std::string kTrainer = bin_dir() + "/mtrain-train";
inline const std::string kMiniSet = source_dir() + "/data/fashion-mnist-mini";

inline std::vector<std::string> concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace mtrain::testing
