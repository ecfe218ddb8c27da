// With several nodes: this node's heartbeat in the store and, on the store's host, the
// watch that finds a node whose launcher fell silent for --heartbeat_timeout
// (Note [Agent heartbeats] in heartbeats.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "launcher/options.h"
#include "launcher/rendezvous.h"

namespace mtrain::launch {

// This node's beats, and on the store's host the watch over the other nodes' counters.
class Heartbeats {
 public:
  using Clock = std::chrono::steady_clock;

  Heartbeats(AttemptChannel& channel, const World& world, bool watch_others, Seconds timeout);

  Clock::time_point next_due() const { return next_; }

  // When due: beats, and (when watching) returns a sentence about the first node silent
  // for the timeout. Store errors propagate.
  std::optional<std::string> tick(bool watch);

 private:
  AttemptChannel& channel_;
  const int node_;
  const bool watch_others_;
  const Clock::duration timeout_;
  const Clock::duration period_;
  std::vector<int64_t> seen_;
  std::vector<Clock::time_point> changed_;
  Clock::time_point next_;
};

}  // namespace mtrain::launch
