#include "launcher/command_line.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "core/error.h"

namespace mtrain::launch {

double parse_seconds(const std::string& text, const std::string& flag, bool allow_zero) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  const bool ok = !text.empty() && end != text.c_str() && *end == '\0' && errno != ERANGE &&
                  std::isfinite(v) && (allow_zero ? v >= 0 : v > 0) && v <= kMaxSeconds;
  if (!ok) {
    throw InvalidArgument(fmt::format("{}: expected a number of seconds {} 0 and at most 1e6, found '{}'", flag,
                                      allow_zero ? ">=" : ">", text));
  }
  return v;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t pos = text.find(sep, start);
    parts.push_back(text.substr(start, pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return parts;
}

}  // namespace mtrain::launch
