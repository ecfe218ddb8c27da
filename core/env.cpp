#include "core/env.h"

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
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end == text.c_str() || *end != '\0' || errno == ERANGE) {
    throw InvalidArgument(fmt::format("{}: expected an integer, found '{}'", what, text));
  }
  if (v < min || v > max) {
    if (max == INT64_MAX) {
      throw InvalidArgument(fmt::format("{}: expected an integer >= {}, found {}", what, min, v));
    }
    throw InvalidArgument(
        fmt::format("{}: expected an integer in [{}, {}], found {}", what, min, max, v));
  }
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
