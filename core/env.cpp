#include "core/env.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "core/error.h"

namespace mtrain::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

int64_t parse_int(const std::string& text, const std::string& what, int64_t min, int64_t max) {
  const auto range = [&] {
    return max == INT64_MAX ? fmt::format("an integer >= {}", min) : fmt::format("an integer in [{}, {}]", min, max);
  };
  // Digits with an optional minus, nothing else: strtoll alone would take " 1" and "+1"
  // but refuse "1 ".
  const bool well_formed = !text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) ||
                                             (text[0] == '-' && text.size() > 1));
  errno = 0;
  char* end = nullptr;
  const long long v = well_formed ? std::strtoll(text.c_str(), &end, 10) : 0;
  if (!well_formed || end == text.c_str() || *end != '\0') {
    throw InvalidArgument(fmt::format("{}: expected an integer, found '{}'", what, text));
  }
  if (errno == ERANGE) throw InvalidArgument(fmt::format("{}: expected {}, found '{}'", what, range(), text));
  if (v < min || v > max) throw InvalidArgument(fmt::format("{}: expected {}, found {}", what, range(), v));
  return v;
}

std::optional<int64_t> get_int(const char* name, int64_t min, int64_t max) {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_int(*v, fmt::format("environment variable {}", name), min, max);
}

std::string get_choice(const char* name, std::initializer_list<const char*> choices) {
  MTRAIN_CHECK(choices.size() > 0, "get_choice({}) without choices", name);
  const auto v = get(name);
  if (!v) return *choices.begin();
  std::string listed;
  for (const char* c : choices) {
    if (*v == c) return *v;
    listed += fmt::format("{}'{}'", listed.empty() ? "" : ", ", c);
  }
  throw InvalidArgument(
      fmt::format("environment variable {}: expected one of {}, found '{}'", name, listed, *v));
}

}  // namespace mtrain::env
