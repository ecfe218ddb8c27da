// Reading a --metrics JSON-lines file back in the end-to-end tests.
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mtrain::testing {

// Every event of `kind` ("step", "epoch", ...) in file order.
inline std::vector<nlohmann::json> read_events(const std::string& path, const std::string& kind) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    auto e = nlohmann::json::parse(line);
    if (e["event"] == kind) out.push_back(e);
  }
  return out;
}

}  // namespace mtrain::testing
