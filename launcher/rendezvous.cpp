#include "launcher/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "core/env.h"
#include "core/error.h"

namespace mtrain::launch {
namespace {

using Clock = std::chrono::steady_clock;

// How often waits on other agents look at the store. Each look is one round trip, and
// rendezvous is once per attempt, so a short period costs nothing and keeps start-up fast.
constexpr Millis kPollPeriod{5};

Millis to_millis(Seconds s) {
  return std::max(Millis{1}, std::chrono::duration_cast<Millis>(s));
}

std::string attempt_prefix(const std::string& run_id, int attempt) {
  return fmt::format("launch/{}/attempt_{}", run_id, attempt);
}

std::unique_ptr<TcpStore> connect_client(const std::string& host, uint16_t port,
                                         const std::string& token, Millis connect_timeout,
                                         const LaunchOptions& options) {
  try {
    return std::make_unique<TcpStore>(host, port, token, kDefaultStoreTimeout, connect_timeout);
  } catch (const Error& e) {
    const std::string what = e.what();
    // A refused token is an answer, not a reachability problem: say only that.
    if (what.find("token") != std::string::npos) {
      throw CommError(fmt::format("could not join the rendezvous store at {}:{}: {}; every "
                                  "node must export the same value",
                                  host, port, what));
    }
    const std::string advice =
        options.mode == RendezvousMode::kStatic
            ? "is node 0's mtrain-launch running with the same --master_addr and "
              "--master_port, and can this host reach it?"
            : "is an mtrain-launch with the same --rdzv_endpoint running on that host, and "
              "can this host reach it?";
    throw CommError(fmt::format("could not join the rendezvous store at {}:{} within "
                                "--rdzv_timeout {} s: {} ({})",
                                host, port, options.rdzv_timeout.count(), what, advice));
  }
}

}  // namespace

AgentStore open_agent_store(const LaunchOptions& options, const std::string& token) {
  AgentStore s;
  s.host = options.store_host;
  const Millis connect_timeout = to_millis(options.rdzv_timeout);
  // Dynamic: --rdzv_conf is_host=false only joins; is_host=true must host.
  const bool must_host = options.mode == RendezvousMode::kStatic || options.rdzv_is_host.value_or(false);
  const bool try_hosting = options.mode == RendezvousMode::kDynamic ? options.rdzv_is_host.value_or(true)
                                                                     : options.node_rank == 0;
  if (try_hosting) {
    try {
      // An empty token: a loopback-only rendezvous without MTRAIN_STORE_TOKEN (Note [A
      // token for the launchers' store] in agent.cpp).
      s.server = token.empty() ? std::make_unique<TcpStoreServer>(options.store_host, options.store_port,
                                                                  TcpStoreServer::Unauthenticated{})
                               : std::make_unique<TcpStoreServer>(options.store_host, options.store_port, token);
    } catch (const CommError& e) {
      // Static node 0 (and a dynamic agent told is_host=true) must host: its bind error
      // (naming the port) is the answer. Otherwise, in the dynamic rendezvous, a failed
      // bind means another agent hosts it, or the endpoint is not this host; either way
      // this agent joins as a client.
      if (must_host) throw;
      spdlog::debug("not hosting the rendezvous store at {}:{} ({}); joining it",
                    options.store_host, options.store_port, e.what());
    }
  }
  s.port = s.server ? s.server->port() : options.store_port;
  s.client = connect_client(s.host, s.port, token, connect_timeout, options);
  if (options.multi_node()) {
    if (s.is_host()) {
      spdlog::info("hosting the rendezvous store at {}:{}; the other nodes connect there",
                   s.host, s.port);
      if (const auto loopback = loopback_only_address(s.host)) {
        spdlog::warn("the rendezvous store listens on {} ({}), a loopback address: only nodes "
                     "on this machine can reach it. On several machines pass {} with an "
                     "address of this node that the others can reach",
                     s.host, *loopback,
                     options.mode == RendezvousMode::kStatic ? "--master_addr"
                                                             : "--rdzv_endpoint");
      }
    } else {
      spdlog::info("joined the rendezvous store at {}:{}", s.host, s.port);
    }
  }
  return s;
}

std::optional<std::string> loopback_only_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return std::nullopt;
  std::optional<std::string> first;
  bool all_loopback = true;
  for (const addrinfo* ai = found; ai != nullptr && all_loopback; ai = ai->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    bool loopback = false;
    if (ai->ai_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(ai->ai_addr);
      loopback = (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
      ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
    } else if (ai->ai_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(ai->ai_addr);
      loopback = IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr) ||
                 (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr) && v6->sin6_addr.s6_addr[12] == 127);
      ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
    }
    all_loopback = loopback;
    if (loopback && !first) first = text;
  }
  ::freeaddrinfo(found);
  if (!all_loopback) return std::nullopt;
  return first;
}

// Note [Joining a running job]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With --nnodes MIN:MAX a node may arrive after its round closed, while the job runs below
// MAX (torchrun's "waiting" nodes). It does not fail: it joins the next round, which no one
// else has entered yet, and waits there. Each running agent looks at that round's join
// counter every --monitor_interval; seeing a node there, the first to notice announces a
// re-form on the attempt's "failed" key (a notice with reform_nodes, not a failure), every
// agent stops its workers as for a failure (SIGTERM: mtrain-train checkpoints after the
// step its ranks agree on), and all enter the next round expecting the old count plus the
// waiting nodes. A re-form spends no restart; the workers resume from the checkpoint in
// the larger world. A node that finds that round closed too (another node was faster)
// waits in the one after, which starts the next re-form. A node that arrives while the
// job runs at MAX is refused: there is no room for it.
World rendezvous(Store& store, const LaunchOptions& options, const std::string& run_id,
                 int attempt, int previous_nodes, const std::string& store_address,
                 const InterruptCheck& check) {
  const std::string prefix = attempt_prefix(run_id, attempt);
  const auto deadline = Clock::now() + options.rdzv_timeout;
  World w;
  w.attempt = attempt;

  if (options.mode == RendezvousMode::kStatic) {
    w.node_rank = options.node_rank;
    w.num_nodes = options.max_nodes;
    if (store.add(fmt::format("{}/claim/{}", prefix, w.node_rank), 1) > 1) {
      throw InvalidArgument(fmt::format(
          "two launchers claim --node_rank {} of job '{}' at {}; give each node its own rank "
          "in [0, {})",
          w.node_rank, run_id, store_address, w.num_nodes));
    }
  } else {
    const int64_t order = store.add(prefix + "/joined", 1);
    w.node_rank = static_cast<int>(order - 1);
    if (options.node_rank != 0 && attempt == 0) {
      spdlog::warn("--node_rank is ignored with --rdzv_endpoint: node ranks follow join order "
                   "(this node joined as {})", w.node_rank);
    }
  }
  // The settings every node must share, published before nproc so that a node whose
  // nproc key is visible has its settings visible too.
  const std::string settings = fmt::format("--nnodes {}:{}, --max_restarts {}", options.min_nodes,
                                           options.max_nodes, options.max_restarts);
  store.set(fmt::format("{}/settings/{}", prefix, w.node_rank), settings);
  store.set(fmt::format("{}/nproc/{}", prefix, w.node_rank), std::to_string(options.nproc_per_node));
  // A node started with other settings would wait for nodes that never come, or give up
  // (no restart) while the others restart: refuse as soon as its settings are seen.
  std::vector<bool> settings_checked;  // by node: read once, while waiting for the rest
  const auto check_settings = [&](int nodes) {
    settings_checked.resize(static_cast<size_t>(nodes), false);
    for (int n = 0; n < nodes; ++n) {
      const std::string key = fmt::format("{}/settings/{}", prefix, n);
      if (n == w.node_rank || settings_checked[static_cast<size_t>(n)] || !store.check({key})) continue;
      settings_checked[static_cast<size_t>(n)] = true;
      const std::string theirs = store.get_string(key);
      if (theirs == settings) continue;
      // Every node present sees some mismatch and refuses. Each says so in the store and
      // waits (briefly) until all present have, so that the node hosting the store does
      // not exit, taking the store with it, while another is still reading the settings:
      // that node would report a closed store instead of the reason.
      int present = 0;
      for (int m = 0; m < nodes; ++m) present += store.check({fmt::format("{}/settings/{}", prefix, m)}) ? 1 : 0;
      try {
        const std::string refused = prefix + "/settings_refused";
        store.add(refused, 1);
        const auto until = Clock::now() + std::chrono::seconds(5);
        while (store.add(refused, 0) < present && Clock::now() < until) std::this_thread::sleep_for(kPollPeriod);
      } catch (const Error&) {
        // The host is gone already: nothing left to wait for.
      }
      throw InvalidArgument(fmt::format(
          "node {} of job '{}' was started with {}, this node (node {}) with {}; every node needs the same "
          "--nnodes and --max_restarts",
          n, run_id, theirs, w.node_rank, settings));
    }
  };

  if (options.mode == RendezvousMode::kDynamic) {
    // Close the round once MAX nodes joined, or MIN joined and the last-call window has
    // passed; compare_set makes the first closer's count the answer for everyone.
    const std::string closed_key = prefix + "/closed";
    const auto last_call = attempt > 0 ? options.rdzv_last_call + options.term_timeout
                                       : options.rdzv_last_call;
    const int64_t enough = previous_nodes > 0 ? std::min(previous_nodes, options.max_nodes)
                                              : options.max_nodes;
    std::optional<Clock::time_point> min_reached_at;
    while (true) {
      check();
      if (store.check({closed_key})) break;
      const int64_t joined = store.add(prefix + "/joined", 0);
      std::optional<int64_t> close_with;
      if (joined >= enough) {
        close_with = std::min<int64_t>(joined, options.max_nodes);
      } else if (joined >= options.min_nodes) {
        if (!min_reached_at) min_reached_at = Clock::now();
        if (Clock::now() - *min_reached_at >= last_call) close_with = joined;
      }
      if (close_with) {
        store.compare_set(closed_key, Bytes{}, to_bytes(std::to_string(*close_with)));
        break;
      }
      if (Clock::now() >= deadline) {
        throw TimeoutError(fmt::format(
            "rendezvous of job '{}' (attempt {}) at {} timed out after --rdzv_timeout {} s: "
            "expected at least {} node(s) to join, found {}",
            run_id, attempt, store_address, options.rdzv_timeout.count(), options.min_nodes,
            joined));
      }
      std::this_thread::sleep_for(kPollPeriod);
    }
    w.num_nodes = static_cast<int>(
        env::parse_int(store.get_string(closed_key), "rendezvous node count", 1));
    if (w.node_rank >= w.num_nodes) {
      if (w.num_nodes < options.max_nodes) {
        spdlog::info("rendezvous of job '{}' (attempt {}) closed with {} node(s) before this node joined; waiting "
                     "for them to re-form the job with it",
                     run_id, attempt, w.num_nodes);
        return rendezvous(store, options, run_id, attempt + 1, w.num_nodes + 1, store_address, check);
      }
      throw CommError(fmt::format(
          "rendezvous of job '{}' (attempt {}) at {} closed with {} node(s) before this node "
          "joined as number {}; the job runs with --nnodes MAX = {} nodes, so it has no room for this one",
          run_id, attempt, store_address, w.num_nodes, w.node_rank + 1, options.max_nodes));
    }
  }

  std::vector<std::string> keys;
  for (int n = 0; n < w.num_nodes; ++n) keys.push_back(fmt::format("{}/nproc/{}", prefix, n));
  while (!store.check(keys)) {
    check();
    check_settings(w.num_nodes);
    if (Clock::now() >= deadline) {
      std::vector<int> missing;
      for (int n = 0; n < w.num_nodes; ++n) {
        if (!store.check({keys[static_cast<size_t>(n)]})) missing.push_back(n);
      }
      throw TimeoutError(fmt::format(
          "rendezvous of job '{}' (attempt {}) at {} timed out after --rdzv_timeout {} s: "
          "node rank(s) {} of {} never joined",
          run_id, attempt, store_address, options.rdzv_timeout.count(), fmt::join(missing, ", "),
          w.num_nodes));
    }
    std::this_thread::sleep_for(kPollPeriod);
  }
  check_settings(w.num_nodes);
  for (const auto& key : keys) {
    w.nproc_per_node.push_back(
        static_cast<int>(env::parse_int(store.get_string(key), "nproc of " + key, 1)));
  }
  w.rank_offset = std::accumulate(w.nproc_per_node.begin(),
                                  w.nproc_per_node.begin() + w.node_rank, 0);
  w.world_size = std::accumulate(w.nproc_per_node.begin(), w.nproc_per_node.end(), 0);
  return w;
}

uint16_t reserve_free_port(const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(address.c_str(), "0", &hints, &found); rc != 0) {
    throw CommError(fmt::format("cannot reserve a port for the workers on {}: {}", address, ::gai_strerror(rc)));
  }
  const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  const bool ok = fd >= 0 && ::bind(fd, found->ai_addr, found->ai_addrlen) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  if (!ok) {
    throw CommError(fmt::format("cannot reserve a port for the workers on {}: {}", address, std::strerror(err)));
  }
  return ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                          : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
}

AttemptChannel::AttemptChannel(Store& store, const std::string& run_id, int attempt)
    : store_(store), prefix_(attempt_prefix(run_id, attempt)), next_prefix_(attempt_prefix(run_id, attempt + 1)) {}

int64_t AttemptChannel::nodes_waiting() { return store_.add(next_prefix_ + "/joined", 0); }

std::string AttemptChannel::key(const std::string& name) const { return prefix_ + "/" + name; }

namespace {

// Messages come from workers' error files and may hold bytes that are not UTF-8 (a
// truncated record, a Latin-1 path); nlohmann's strict dump would throw on them and take
// the launcher down before it reports anything.
std::string dump_for_store(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

nlohmann::json notice_to_json(const FailureNotice& n) {
  return {{"node_rank", n.node_rank},
          {"what", n.what},
          {"restartable", n.restartable},
          {"lost_nodes", n.lost_nodes},
          {"reform_nodes", n.reform_nodes}};
}

FailureNotice notice_from_bytes(const Bytes& b) {
  try {
    const auto j = nlohmann::json::parse(to_string(b));
    return FailureNotice{j.at("node_rank").get<int>(), j.at("what").get<std::string>(),
                         j.at("restartable").get<bool>(), j.value("lost_nodes", 0), j.value("reform_nodes", 0)};
  } catch (const nlohmann::json::exception& e) {
    throw CommError(fmt::format("failure notice in the store is not the launcher's JSON: '{}' ({})",
                                to_string(b), e.what()));
  }
}

}  // namespace

FailureNotice AttemptChannel::announce_failure(const FailureNotice& notice) {
  const Bytes mine = to_bytes(dump_for_store(notice_to_json(notice)));
  const Bytes winner = store_.compare_set(key("failed"), Bytes{}, mine);
  return notice_from_bytes(winner);
}

std::optional<FailureNotice> AttemptChannel::failure_notice() {
  if (!store_.check({key("failed")})) return std::nullopt;
  return notice_from_bytes(store_.get(key("failed")));
}

void AttemptChannel::publish_root_cause(const Failure& root_cause) {
  store_.compare_set(key("root_cause"), Bytes{}, to_bytes(dump_for_store(failure_to_json(root_cause))));
}

std::optional<Failure> AttemptChannel::wait_root_cause(Millis timeout, const InterruptCheck& check) {
  const auto deadline = Clock::now() + timeout;
  while (!store_.check({key("root_cause")})) {
    check();
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(kPollPeriod);
  }
  try {
    return failure_from_json(nlohmann::json::parse(store_.get_string(key("root_cause"))));
  } catch (const nlohmann::json::exception& e) {
    throw CommError(fmt::format("root cause in the store is not valid JSON: {}", e.what()));
  }
}

void AttemptChannel::publish_worker_master(const std::string& address, uint16_t port) {
  store_.set(key("worker_master"), fmt::format("{} {}", address, port));
}

std::pair<std::string, uint16_t> AttemptChannel::wait_worker_master(Millis timeout, const InterruptCheck& check) {
  const auto deadline = Clock::now() + timeout;
  while (!store_.check({key("worker_master")})) {
    check();
    if (Clock::now() >= deadline) {
      throw CommError(fmt::format("node 0 did not publish its workers' MASTER_ADDR and MASTER_PORT within {} s",
                                  std::chrono::duration_cast<std::chrono::seconds>(timeout).count()));
    }
    std::this_thread::sleep_for(kPollPeriod);
  }
  const std::string text = store_.get_string(key("worker_master"));
  const size_t space = text.rfind(' ');
  if (space == std::string::npos) throw CommError(fmt::format("malformed worker master '{}' in the store", text));
  return {text.substr(0, space),
          static_cast<uint16_t>(env::parse_int(text.substr(space + 1), "the workers' MASTER_PORT", 1, 65535))};
}

void AttemptChannel::mark_succeeded() { store_.add(key("succeeded"), 1); }

bool AttemptChannel::all_succeeded(int num_nodes) {
  return store_.add(key("succeeded"), 0) >= num_nodes;
}

void AttemptChannel::heartbeat(int node) { store_.add(key(fmt::format("alive/{}", node)), 1); }

std::vector<int64_t> AttemptChannel::heartbeats(int num_nodes) {
  std::vector<int64_t> counts(static_cast<size_t>(num_nodes));
  for (int n = 0; n < num_nodes; ++n) counts[static_cast<size_t>(n)] = store_.add(key(fmt::format("alive/{}", n)), 0);
  return counts;
}

void announce_leaving(Store& store, const std::string& run_id) {
  store.add(fmt::format("launch/{}/left", run_id), 1);
}

void wait_for_others_to_leave(Store& store, const std::string& run_id, int others,
                              Millis timeout, const InterruptCheck& check) {
  const auto deadline = Clock::now() + timeout;
  const std::string key = fmt::format("launch/{}/left", run_id);
  while (store.add(key, 0) < others) {
    check();
    if (Clock::now() >= deadline) {
      spdlog::warn("closing the rendezvous store although only {} of {} other node(s) said "
                   "they are done with it",
                   store.add(key, 0), others);
      return;
    }
    std::this_thread::sleep_for(kPollPeriod);
  }
}

}  // namespace mtrain::launch
