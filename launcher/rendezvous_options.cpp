#include "launcher/rendezvous_options.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <iterator>
#include <map>

#include "core/env.h"
#include "core/error.h"

namespace mtrain::launch {
namespace {

// torchrun's _parse_rendezvous_config: "k1=v1,k2=v2", every key with a value.
std::map<std::string, std::string> parse_rdzv_conf(const std::string& text) {
  std::map<std::string, std::string> conf;
  if (text.find_first_not_of(' ') == std::string::npos) return conf;
  for (const std::string& item : split(text, ',')) {
    const size_t eq = item.find('=');
    const auto trim = [](std::string t) {
      t.erase(0, t.find_first_not_of(' '));
      t.erase(t.find_last_not_of(' ') + 1);
      return t;
    };
    const std::string key = trim(item.substr(0, eq));
    const std::string value = eq == std::string::npos ? "" : trim(item.substr(eq + 1));
    if (key.empty() || value.empty()) {
      throw InvalidArgument(fmt::format("--rdzv_conf: expected KEY=VALUE,... with a value for every key, found '{}'",
                                        item));
    }
    conf[key] = value;
  }
  return conf;
}

// c10d's get_as_bool spellings.
bool parse_conf_bool(const std::string& value, const std::string& what) {
  std::string v = value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "t" || v == "yes" || v == "y") return true;
  if (v == "0" || v == "false" || v == "f" || v == "no" || v == "n") return false;
  throw InvalidArgument(fmt::format("{}: expected true or false (1/0, yes/no), found '{}'", what, value));
}

// What the --rdzv_conf keys write into, read as a whole once every key is seen.
struct RdzvConf {
  CommandLine& line;
  double keep_alive_interval = 5;  // torchrun's defaults
  int64_t keep_alive_attempts = 3;
  bool keep_alive = false;
};

// Sets a launcher duration from a key, unless the flag was given with another value.
void set_seconds_from_conf(CommandLine& line, Seconds LaunchOptions::*field, const char* flag, const std::string& key,
                           const std::string& value) {
  const Seconds s{parse_seconds(value, fmt::format("--rdzv_conf {}", key), false)};
  if (line.given.count(flag) != 0 && s != line.options.*field) {
    throw InvalidArgument(fmt::format("--rdzv_conf {}={} contradicts --{} {}: give one of them", key, value, flag,
                                      (line.options.*field).count()));
  }
  line.options.*field = s;
}

struct RdzvKey {
  const char* key;
  void (*apply)(RdzvConf& conf, const std::string& what, const std::string& value);
};

// Note [Rendezvous settings from --rdzv_conf]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchrun passes --rdzv_conf to its rendezvous backends; these are the keys they read.
// Each either sets the launcher's own setting, is accepted (and checked) for a setting
// that has no counterpart here, or is refused; docs/launcher.md lists them with the
// reasons. A key that sets a flag also given explicitly with another value is an error,
// not a guess. `what` is "--rdzv_conf KEY", for messages.
constexpr RdzvKey kRdzvKeys[] = {
    {"timeout",
     [](RdzvConf& c, const std::string&, const std::string& v) {
       set_seconds_from_conf(c.line, &LaunchOptions::rdzv_timeout, "rdzv_timeout", "timeout", v);
     }},
    {"join_timeout",
     [](RdzvConf& c, const std::string&, const std::string& v) {
       set_seconds_from_conf(c.line, &LaunchOptions::rdzv_timeout, "rdzv_timeout", "join_timeout", v);
     }},
    {"last_call_timeout",
     [](RdzvConf& c, const std::string&, const std::string& v) {
       set_seconds_from_conf(c.line, &LaunchOptions::rdzv_last_call, "rdzv_last_call", "last_call_timeout", v);
     }},
    {"keep_alive_interval",
     [](RdzvConf& c, const std::string& what, const std::string& v) {
       c.keep_alive_interval = parse_seconds(v, what, false);
       c.keep_alive = true;
     }},
    {"keep_alive_max_attempt",
     [](RdzvConf& c, const std::string& what, const std::string& v) {
       c.keep_alive_attempts = env::parse_int(v, what, 1, 1 << 20);
       c.keep_alive = true;
     }},
    {"is_host",
     [](RdzvConf& c, const std::string& what, const std::string& v) {
       c.line.options.rdzv_is_host = parse_conf_bool(v, what);
     }},
    {"close_timeout", [](RdzvConf&, const std::string& what, const std::string& v) { parse_seconds(v, what, false); }},
    {"read_timeout", [](RdzvConf&, const std::string& what, const std::string& v) { parse_seconds(v, what, false); }},
    {"use_libuv", [](RdzvConf&, const std::string& what, const std::string& v) { parse_conf_bool(v, what); }},
    {"rank", [](RdzvConf&, const std::string& what, const std::string& v) { env::parse_int(v, what, 0); }},
    {"store_type",
     [](RdzvConf&, const std::string& what, const std::string& v) {
       if (v != "tcp") {
         throw InvalidArgument(
             fmt::format("{}={}: the launchers' rendezvous store is a TCP store (expected 'tcp')", what, v));
       }
     }},
};

// An endpoint, or --rdzv_backend c10d, means the dynamic rendezvous.
void check_backend(const DependentFlags& given, bool standalone) {
  const std::string backend = given.rdzv_backend.value_or("");
  if (given.rdzv_backend && backend != "static" && backend != "c10d") {
    throw InvalidArgument(
        fmt::format("--rdzv_backend: expected 'static' or 'c10d', found '{}'", backend));
  }
  if (backend == "static" && given.rdzv_endpoint) {
    throw InvalidArgument("--rdzv_endpoint belongs to the dynamic rendezvous "
                          "(--rdzv_backend c10d); the static one uses --master_addr and "
                          "--master_port");
  }
  if (backend == "c10d" && !given.rdzv_endpoint && !standalone) {
    throw InvalidArgument("--rdzv_backend c10d: expected --rdzv_endpoint HOST:PORT, found none");
  }
}

void resolve_standalone(const DependentFlags& given, LaunchOptions& o,
                        std::vector<std::string>& ignored) {
  if (o.max_nodes != 1) {
    throw InvalidArgument(fmt::format(
        "--standalone runs a single node, found --nnodes {}", given.nnodes));
  }
  // As torchrun, --standalone overrides the rendezvous flags; they are still checked,
  // so that a typo is not hidden until the flag is used without --standalone.
  if (given.master_addr && given.master_addr->empty()) {
    throw InvalidArgument("--master_addr: expected an address, found ''");
  }
  if (given.master_port) env::parse_int(*given.master_port, "--master_port", 0, 65535);
  if (given.rdzv_endpoint) parse_endpoint(*given.rdzv_endpoint, "--rdzv_endpoint", kDefaultRdzvPort);
  if (given.rdzv_id && given.rdzv_id->empty()) throw InvalidArgument("--rdzv_id: expected a non-empty job id");
  const std::pair<const char*, const std::optional<std::string>*> overridden[] = {
      {"master_addr", &given.master_addr},     {"master_port", &given.master_port},
      {"rdzv_endpoint", &given.rdzv_endpoint}, {"rdzv_backend", &given.rdzv_backend},
      {"rdzv_id", &given.rdzv_id}};
  for (const auto& [flag, value] : overridden) {
    if (*value) {
      ignored.push_back(fmt::format(
          "--{} {} is ignored: --standalone runs its own store on 127.0.0.1 at a free port with a random "
          "run id",
          flag, **value));
    }
  }
  o.mode = RendezvousMode::kStatic;
  o.store_host = "127.0.0.1";
  o.store_port = 0;
  o.rdzv_id.clear();  // the agent draws a random one
}

void resolve_dynamic(const DependentFlags& given, LaunchOptions& o) {
  o.mode = RendezvousMode::kDynamic;
  std::tie(o.store_host, o.store_port) =
      parse_endpoint(*given.rdzv_endpoint, "--rdzv_endpoint", kDefaultRdzvPort);
  if (o.multi_node() && o.store_port == 0) {
    throw InvalidArgument("--rdzv_endpoint: port 0 cannot be used with several nodes "
                          "(every node must know the port in advance); give a fixed port");
  }
  if (given.master_addr || given.master_port) {
    throw InvalidArgument("--master_addr/--master_port belong to the static rendezvous; "
                          "with --rdzv_endpoint the store lives at the endpoint");
  }
}

void resolve_static(const DependentFlags& given, LaunchOptions& o) {
  if (o.min_nodes != o.max_nodes) {
    throw InvalidArgument(fmt::format(
        "--nnodes {}: MIN:MAX needs the dynamic rendezvous (--rdzv_endpoint HOST:PORT "
        "--rdzv_id ID); the static one needs a fixed node count",
        given.nnodes));
  }
  o.mode = RendezvousMode::kStatic;
  if (given.master_addr) o.store_host = *given.master_addr;
  if (o.store_host.empty()) throw InvalidArgument("--master_addr: expected an address, found ''");
  if (given.master_port) {
    o.store_port = static_cast<uint16_t>(
        env::parse_int(*given.master_port, "--master_port", 0, 65535));
    if (o.multi_node() && o.store_port == 0) {
      throw InvalidArgument("--master_port 0 (a free port) works only on a single node: "
                            "the other nodes could not know the port; give a fixed port");
    }
  } else {
    o.store_port = o.multi_node() ? kDefaultMasterPort : 0;
  }
}

void resolve_node_rank(const DependentFlags& given, LaunchOptions& o) {
  if (!given.node_rank) return;
  const int64_t node_rank = env::parse_int(*given.node_rank, "--node_rank", 0);
  // Dynamic: ranks come from join order; a --node_rank left in a script is ignored
  // (the agent says so).
  if (o.mode != RendezvousMode::kStatic) return;
  if (node_rank >= o.max_nodes) {
    throw InvalidArgument(fmt::format(
        "--node_rank: expected a rank in [0, {}) for --nnodes {}, found {}", o.max_nodes,
        o.max_nodes, node_rank));
  }
  o.node_rank = static_cast<int>(node_rank);
}

}  // namespace

void apply_rdzv_conf(CommandLine& line) {
  if (!line.dependent.rdzv_conf) return;
  RdzvConf conf{line};
  for (const auto& [key, value] : parse_rdzv_conf(*line.dependent.rdzv_conf)) {
    const auto* known = std::find_if(std::begin(kRdzvKeys), std::end(kRdzvKeys),
                                     [&](const RdzvKey& k) { return key == k.key; });
    if (known == std::end(kRdzvKeys)) {
      std::string keys;
      for (const RdzvKey& k : kRdzvKeys) keys += fmt::format("{}{}", keys.empty() ? "" : ", ", k.key);
      throw InvalidArgument(fmt::format("--rdzv_conf: unknown key '{}'; expected one of {}", key, keys));
    }
    known->apply(conf, fmt::format("--rdzv_conf {}", key), value);
  }
  if (conf.keep_alive) {
    // torchrun's node is dead after max_attempt missed keep-alives; here, after
    // --heartbeat_timeout without a heartbeat.
    set_seconds_from_conf(line, &LaunchOptions::heartbeat_timeout, "heartbeat_timeout",
                          "keep_alive_interval x keep_alive_max_attempt",
                          fmt::format("{}", conf.keep_alive_interval * static_cast<double>(conf.keep_alive_attempts)));
  }
}

// Where the store is, whose it is, and this node's rank in it.
void resolve_rendezvous(CommandLine& line, std::vector<std::string>& ignored) {
  const DependentFlags& given = line.dependent;
  LaunchOptions& o = line.options;
  check_backend(given, o.standalone);
  if (o.standalone) {
    resolve_standalone(given, o, ignored);
  } else if (given.rdzv_endpoint) {
    resolve_dynamic(given, o);
  } else {
    resolve_static(given, o);
  }
  if (o.rdzv_is_host && o.mode != RendezvousMode::kDynamic) {
    ignored.push_back(fmt::format("--rdzv_conf is_host={} is ignored: it belongs to the dynamic rendezvous; in the "
                                  "static one node 0 hosts the store",
                                  *o.rdzv_is_host));
    o.rdzv_is_host.reset();
  }
  if (given.rdzv_id && !o.standalone) o.rdzv_id = *given.rdzv_id;
  if (!o.standalone && o.rdzv_id.empty()) {
    throw InvalidArgument("--rdzv_id: expected a non-empty job id");
  }
  resolve_node_rank(given, o);
}

}  // namespace mtrain::launch
