// What the launcher's flag readers fill in, before the flags that depend on others are
// resolved: shared by options.cpp (the flag table) and rendezvous_options.cpp (--rdzv_conf and
// the rendezvous mode). Internal to launcher/.
#pragma once

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "launcher/options.h"

namespace mtrain::launch {

// Durations become clock deadlines and poll() timeouts in milliseconds: 1e6 s (11.5
// days) keeps both far from overflow and is longer than any scheduler's time limit.
inline constexpr double kMaxSeconds = 1e6;

// A number of seconds in (0, kMaxSeconds], or [0, kMaxSeconds] with `allow_zero`; else
// InvalidArgument naming `flag` and the text.
double parse_seconds(const std::string& text, const std::string& flag, bool allow_zero);
// `text` cut at every `sep` (an empty text gives one empty part).
std::vector<std::string> split(const std::string& text, char sep);

// The flags whose meaning depends on other flags, kept as given (nullopt: absent) until
// every flag is read: --standalone overrides the rendezvous flags, an endpoint makes the
// rendezvous dynamic, and node and local ranks are checked against the counts.
struct DependentFlags {
  std::string nnodes;  // as given, for messages
  std::optional<std::string> node_rank;
  std::optional<std::string> master_addr;
  std::optional<std::string> master_port;
  std::optional<std::string> rdzv_endpoint;
  std::optional<std::string> rdzv_id;
  std::optional<std::string> rdzv_backend;
  std::optional<std::string> local_ranks_filter;
  std::optional<std::string> rdzv_conf;
};

// What the flag table's readers fill in.
struct CommandLine {
  LaunchOptions options;
  DependentFlags dependent;
  std::set<std::string> given;                 // flags set on the command line or by PET_*
  std::vector<std::string> from_environment;   // "PET_X=value" for each flag PET_* set
};

}  // namespace mtrain::launch
