#include "launcher/heartbeats.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace mtrain::launch {

// Note [Agent heartbeats]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A launcher that dies without a word (SIGKILL, an OOM kill, a lost machine or network)
// announces no failure, and its workers die with it: the other nodes' workers would hang
// in their next collective, and a node whose workers all succeeded would wait for that
// node's success forever. So with several nodes each agent adds 1 to `alive/<node>` about
// once a second (every --heartbeat_timeout / 4 when that is shorter), through teardowns
// too, and the agent hosting the store alone reads the counters, one read per node per
// beat: a node whose counter has not moved for --heartbeat_timeout is lost, and the host
// announces it as the attempt's failure. A lost node cannot rejoin, so no restart follows.
// The host's own death is a lost store, which every agent sees when a request fails or
// gets no answer for --heartbeat_timeout (the store client's timeout).

Heartbeats::Heartbeats(AttemptChannel& channel, const World& world, bool watch_others, Seconds timeout)
    : channel_(channel),
      node_(world.node_rank),
      watch_others_(watch_others),
      timeout_(std::chrono::duration_cast<Clock::duration>(timeout)),
      period_(std::min<Clock::duration>(std::chrono::seconds(1), timeout_ / 4)),
      seen_(static_cast<size_t>(world.num_nodes), -1),
      changed_(static_cast<size_t>(world.num_nodes), Clock::now()),
      next_(Clock::now()) {}

std::optional<std::string> Heartbeats::tick(bool watch) {
  const auto now = Clock::now();
  if (now < next_) return std::nullopt;
  next_ = now + period_;
  channel_.heartbeat(node_);
  if (!watch_others_) return std::nullopt;
  const std::vector<int64_t> counts = channel_.heartbeats(static_cast<int>(seen_.size()));
  std::optional<std::string> lost;
  for (size_t n = 0; n < counts.size(); ++n) {
    if (counts[n] != seen_[n]) {
      seen_[n] = counts[n];
      changed_[n] = now;
    } else if (watch && static_cast<int>(n) != node_ && !lost && now - changed_[n] >= timeout_) {
      lost = fmt::format("the launcher on node {} stopped responding: no heartbeat for {:g} s "
                         "(--heartbeat_timeout; its machine or its launcher died, or the network "
                         "to it is down)",
                         n, std::chrono::duration<double>(now - changed_[n]).count());
    }
  }
  return lost;
}

}  // namespace mtrain::launch
