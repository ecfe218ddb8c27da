// Reading environment variables with clear errors (the worker and launcher contracts
// are environment variables, so bad values must name the variable and the value).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace mtrain::env {

// The variable's value, or nullopt when unset. An empty value counts as set.
std::optional<std::string> get(const char* name);

// Parses a decimal integer; throws InvalidArgument naming the variable when the value
// is not an integer or lies outside [min, max]. Unset -> nullopt.
std::optional<int64_t> get_int(const char* name, int64_t min = INT64_MIN, int64_t max = INT64_MAX);

// The variable's value when it is one of `choices`, the first choice when unset; any
// other value throws InvalidArgument naming the variable, the value and every choice.
std::string get_choice(const char* name, std::initializer_list<const char*> choices);

// Strict integer parse of `text` for messages about `what` (a flag or variable name).
int64_t parse_int(const std::string& text, const std::string& what,
                  int64_t min = INT64_MIN, int64_t max = INT64_MAX);

}  // namespace mtrain::env
