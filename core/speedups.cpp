#include "core/speedups.h"

#include <fmt/format.h>

#include "core/env.h"
#include "core/error.h"

namespace mtrain {

namespace {

struct Switch {
  const char* name;
  bool Speedups::*field;
};

// Note [Speed switches]: one row each.
constexpr Switch kSwitches[] = {
    {"fused-bn", &Speedups::fused_bn},
    {"skip-conv-bias", &Speedups::skip_conv_bias},
    {"fresh-grads", &Speedups::fresh_grads},
    {"cudnn-graph", &Speedups::cudnn_graph},
    {"amp-activations", &Speedups::amp_activations},
};

constexpr const char* kVariable = "MTRAIN_SPEEDUPS";

// The comma-separated items of `text`, without blanks; empty items are dropped.
std::vector<std::string> items(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  for (const char c : text + ",") {
    if (c == ',') {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else if (c != ' ' && c != '\t') {
      item += c;
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> speedup_names() {
  std::vector<std::string> names;
  for (const Switch& s : kSwitches) names.emplace_back(s.name);
  return names;
}

std::string Speedups::str() const {
  std::vector<std::string> on;
  for (const Switch& s : kSwitches) {
    if (this->*s.field) on.emplace_back(s.name);
  }
  return on.empty() ? "none" : fmt::format("{}", fmt::join(on, ", "));
}

Speedups parse_speedups(const std::string& text, const std::string& source) {
  Speedups on;
  for (const std::string& name : items(text)) {
    if (name == "all") {
      for (const Switch& s : kSwitches) on.*s.field = true;
      continue;
    }
    bool known = false;
    for (const Switch& s : kSwitches) {
      if (name == s.name) {
        on.*s.field = true;
        known = true;
      }
    }
    if (!known) {
      throw InvalidArgument(fmt::format("{}: unknown speedup '{}'; expected a comma-separated list of {} or all",
                                        source, name, fmt::join(speedup_names(), ", ")));
    }
  }
  return on;
}

Speedups speedups_from_environment() {
  const auto value = env::get(kVariable);
  return value ? parse_speedups(*value, fmt::format("environment variable {}", kVariable)) : Speedups{};
}

}  // namespace mtrain
