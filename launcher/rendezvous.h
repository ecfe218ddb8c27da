// The agents' side of the rendezvous store: who hosts it, how nodes agree on the world
// of each attempt, and the per-attempt channel through which a failure on one node
// tears down every node.
//
// Note [Launcher store keys]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Agents and workers share one store (the workers find it through MASTER_ADDR,
// MASTER_PORT and MTRAIN_STORE_TOKEN). Agents use only keys under
// "launch/<run id>/..."; each attempt's workers get MTRAIN_STORE_PREFIX =
// "job/<run id>/attempt_<k>" and are expected to wrap the store in a PrefixStore with
// it, so a restarted gang never sees its predecessor's keys. Per attempt k the agents
// use, under "launch/<run id>/attempt_<k>/":
//   claim/<node>   static: counts agents claiming a node rank (a duplicate is an error)
//   joined         dynamic: join counter; the value returned by add() is the join order
//   closed         dynamic: the final node count, set once with compare_set
//   settings/<node> that node's --nnodes and --max_restarts, which must match everyone's
//   settings_refused counts the nodes that found a mismatch (each waits for the others)
//   nproc/<node>   workers on that node; offsets are prefix sums in node order
//   failed         the first failure notice (compare_set: the first node wins)
//   root_cause     the winning node's full root cause, published after its teardown
//   succeeded      counter of nodes whose workers all exited 0
//   alive/<node>   that node's heartbeat counter (Note [Agent heartbeats] in heartbeats.cpp)
// and "launch/<run id>/left" counts agents that are done with the store, so that the
// hosting agent keeps it alive until every other agent has read its last key.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/store.h"
#include "launcher/failure_report.h"
#include "launcher/options.h"

namespace mtrain::launch {

// The store as this agent sees it. `host`/`port` are what workers dial.
struct AgentStore {
  std::unique_ptr<TcpStoreServer> server;  // set when this agent hosts the store
  std::unique_ptr<TcpStore> client;
  std::string host;
  uint16_t port = 0;
  bool is_host() const { return server != nullptr; }
};

// Static: node 0 hosts at --master_addr:--master_port, the others connect. Dynamic: the
// agent that can bind --rdzv_endpoint hosts it (like c10d's is_host), the others
// connect. Connecting gives up after --rdzv_timeout with an error naming the address.
// With several nodes it says (at info level) which address it hosts or joined, and
// warns when the hosted store is only reachable from this machine (Note [Store
// address across hosts]).
AgentStore open_agent_store(const LaunchOptions& options, const std::string& token);

// Note [Store address across hosts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The store binds exactly the address it is given, and every worker's MTRAIN_STORE_ADDR is
// that same string, so the Gloo transport binds the local interface that routes to it
// (collectives/gloo/gloo_device.h). Across machines that address must therefore be one
// the other nodes can reach. The classic mistake is a loopback one: the default
// 127.0.0.1, or `--master_addr=$(hostname)` on a Debian-style host whose /etc/hosts
// maps its own name to 127.0.1.1. Node 0 then binds loopback and every other node
// waits for --rdzv_timeout, with nothing on node 0 saying why. Several nodes on one
// machine (tests, a laptop) legitimately use loopback, so this is a warning on the
// hosting node, not an error.

// When every address `host` resolves to is a loopback one (127.0.0.0/8, ::1, or an
// IPv4-mapped 127.x), the first of them, numeric; otherwise (or when it does not
// resolve) nullopt.
std::optional<std::string> loopback_only_address(const std::string& host);

// The job's world for one attempt.
// A TCP port on `address` that nothing listens on now: bound, read back and released
// (Note [Worker rendezvous for other frameworks] in attempt.cpp). Throws CommError.
uint16_t reserve_free_port(const std::string& address);

struct World {
  int attempt = 0;  // the round this node joined (a late node joins the one under way)
  int node_rank = 0;
  int num_nodes = 1;
  int rank_offset = 0;  // global rank of this node's local rank 0
  int world_size = 1;
  std::vector<int> nproc_per_node;
};

// Called while waiting; throws to abort the wait (the agent uses it for signals).
using InterruptCheck = std::function<void()>;

// Agrees on the world of `attempt` with the other agents (Note [Launcher store keys]).
// Throws TimeoutError naming the store address and who is missing after --rdzv_timeout.
// `previous_nodes` (dynamic only) is the node count the round expects (the attempt
// before a restart, less the nodes known lost, plus those waiting to join): the round
// closes as soon as that many joined, and peers still stopping their workers get
// --term_timeout on top of the last-call window. A node that finds round `attempt`
// closed without it, below --nnodes MAX, waits in the next round instead (Note [Joining
// a running job]); the World says which round it joined.
World rendezvous(Store& store, const LaunchOptions& options, const std::string& run_id,
                 int attempt, int previous_nodes, const std::string& store_address,
                 const InterruptCheck& check);

// The short notice that makes every node stop its workers.
struct FailureNotice {
  int node_rank = 0;
  std::string what;          // "rank 3 (node 1): signal 9 (SIGKILL)"
  bool restartable = true;   // false when an agent itself stopped (signal, lost store)
  int lost_nodes = 0;        // nodes the store's host found silent (Note [Agent heartbeats])
  // Not a failure: nodes wait to join, and the job re-forms with this many nodes
  // without spending a restart (Note [Joining a running job]); 0 otherwise.
  int reform_nodes = 0;
};

class AttemptChannel {
 public:
  AttemptChannel(Store& store, const std::string& run_id, int attempt);

  // Announces a failure unless another node was first; returns the winning notice
  // (== `notice` when this node won).
  FailureNotice announce_failure(const FailureNotice& notice);
  // Non-blocking: the notice, if any node announced a failure.
  std::optional<FailureNotice> failure_notice();
  // Nodes that joined the next round's rendezvous while this attempt runs: late nodes
  // waiting to join (Note [Joining a running job]).
  int64_t nodes_waiting();

  void publish_root_cause(const Failure& root_cause);
  // Waits up to `timeout` for the winning node's root cause.
  std::optional<Failure> wait_root_cause(Millis timeout, const InterruptCheck& check);

  // Note [Worker rendezvous for other frameworks] in attempt.cpp: node 0 publishes the
  // MASTER_ADDR:MASTER_PORT of this attempt's workers; the others wait for it (up to
  // `timeout`; CommError after).
  void publish_worker_master(const std::string& address, uint16_t port);
  std::pair<std::string, uint16_t> wait_worker_master(Millis timeout, const InterruptCheck& check);
  // This node's workers all exited 0; true once every node's did.
  void mark_succeeded();
  bool all_succeeded(int num_nodes);

  // Note [Agent heartbeats]: one beat of `node`, and every node's count of beats so far.
  void heartbeat(int node);
  std::vector<int64_t> heartbeats(int num_nodes);

 private:
  std::string key(const std::string& name) const;
  Store& store_;
  std::string prefix_;
  std::string next_prefix_;
};

// Run-level bookkeeping for leaving the store (see "left" above).
void announce_leaving(Store& store, const std::string& run_id);
// Host only: waits (bounded) until `others` agents announced leaving.
void wait_for_others_to_leave(Store& store, const std::string& run_id, int others,
                              Millis timeout, const InterruptCheck& check);

}  // namespace mtrain::launch
