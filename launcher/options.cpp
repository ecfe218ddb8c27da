#include "launcher/options.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cxxopts.hpp>
#include <filesystem>
#include <map>
#include <string_view>

#include "core/env.h"
#include "core/error.h"

namespace mtrain::launch {
namespace {

// Durations become clock deadlines and poll() timeouts in milliseconds: 1e6 s (11.5
// days) keeps both far from overflow and is longer than any scheduler's time limit.
constexpr double kMaxSeconds = 1e6;

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

int count_usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

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

// Checks a flag's value and stores it; `flag` is "--name", for messages.
using ReadFlag = void (*)(CommandLine& line, const std::string& flag, const std::string& value);

// One launcher flag: all that --help, cxxopts and the parser know about it.
struct Flag {
  const char* name;           // underscore spelling; the dashed one is accepted too
  char alias;                 // torchrun's one-letter spelling (-r for --redirects), or 0
  const char* value;          // the value as --help names it; nullptr: a switch
  const char* default_value;  // read when the flag is absent; nullptr: absent stays absent
  const char* help;           // "{default}" shows default_value; '\n' starts a line
  ReadFlag read;
};

enum class Zero { kRefused, kAllowed };

template <Seconds LaunchOptions::*kField, Zero kZero>
void read_seconds(CommandLine& line, const std::string& flag, const std::string& value) {
  line.options.*kField = Seconds(parse_seconds(value, flag, kZero == Zero::kAllowed));
}

template <StreamSelection LaunchOptions::*kField>
void read_streams(CommandLine& line, const std::string& flag, const std::string& value) {
  line.options.*kField = parse_stream_selection(value, flag);
}

template <std::optional<std::string> DependentFlags::*kField>
void read_later(CommandLine& line, const std::string&, const std::string& value) {
  line.dependent.*kField = value;
}

void read_nothing(CommandLine&, const std::string&, const std::string&) {}

// torchrun's flags that have no meaning here: refused with the reason.
constexpr char kNoLogPlugins[] =
    "mtrain-launch loads no log plugins; the log layout is fixed (--log_dir, --redirects, --tee, "
    "--local_ranks_filter; docs/launcher.md, \"Logs\")";
constexpr char kNoNumaBinding[] =
    "NUMA binding is not supported; --cpu_bind cores gives each worker its own neighbouring CPUs "
    "(docs/launcher.md, \"CPU binding\")";

template <const char* kReason>
void refuse(CommandLine&, const std::string& flag, const std::string& value) {
  throw InvalidArgument(fmt::format("{} {}: {}", flag, value, kReason));
}

// Every launcher flag, in the order of --help and of reading: when several values are
// wrong, the first one here is reported. The dependent flags are resolved after all.
constexpr Flag kFlags[] = {
    {"nproc_per_node", 0, "N|cpu|gpu|auto", "1", "workers on this node (default {default})",
     [](CommandLine& line, const std::string& flag, const std::string& value) {
       line.options.nproc_per_node = parse_nproc_per_node(value, flag);
     }},
    {"nnodes", 0, "N|MIN:MAX", "1", "nodes in the job (MIN:MAX needs --rdzv_endpoint)",
     [](CommandLine& line, const std::string&, const std::string& value) {
       std::tie(line.options.min_nodes, line.options.max_nodes) = parse_nnodes(value);
       line.dependent.nnodes = value;
     }},
    {"node_rank", 0, "R", nullptr, "this node's rank, static rendezvous (default 0)",
     read_later<&DependentFlags::node_rank>},
    {"master_addr", 0, "ADDR", nullptr,
     "static: address node 0's store binds and every node\n"
     "dials (default 127.0.0.1)",
     read_later<&DependentFlags::master_addr>},
    {"master_port", 0, "PORT", nullptr,
     "static: store port; 0 = a free port (single node\n"
     "only). Default: free port on one node, 29500 on many",
     read_later<&DependentFlags::master_port>},
    {"rdzv_endpoint", 0, "HOST[:PORT]", nullptr,
     "dynamic rendezvous store (default port 29400); the\n"
     "agent that can bind it hosts the store",
     read_later<&DependentFlags::rdzv_endpoint>},
    {"rdzv_id", 0, "ID", nullptr, "job id shared by every node (default \"none\")",
     read_later<&DependentFlags::rdzv_id>},
    {"rdzv_backend", 0, "static|c10d", nullptr, "torchrun compatibility; c10d = dynamic",
     read_later<&DependentFlags::rdzv_backend>},
    {"rdzv_timeout", 0, "S", "120", "seconds to wait for the other nodes (default {default})",
     read_seconds<&LaunchOptions::rdzv_timeout, Zero::kRefused>},
    {"rdzv_last_call", 0, "S", "3",
     "dynamic, MIN < MAX: seconds to wait for more nodes\n"
     "once MIN have joined (default {default})",
     read_seconds<&LaunchOptions::rdzv_last_call, Zero::kAllowed>},
    {"standalone", 0, nullptr, nullptr, "one node, a free port on 127.0.0.1, a random run id",
     [](CommandLine& line, const std::string&, const std::string&) { line.options.standalone = true; }},
    {"max_restarts", 0, "K", "0", "restart the whole gang up to K times (default {default})",
     [](CommandLine& line, const std::string& flag, const std::string& value) {
       line.options.max_restarts = static_cast<int>(env::parse_int(value, flag, 0, 1 << 20));
     }},
    {"monitor_interval", 0, "S", "0.1", "how often to look for other nodes' failures ({default})",
     read_seconds<&LaunchOptions::monitor_interval, Zero::kRefused>},
    {"term_timeout", 0, "S", "30", "grace between SIGTERM and SIGKILL (default {default})",
     read_seconds<&LaunchOptions::term_timeout, Zero::kAllowed>},
    {"heartbeat_timeout", 0, "S", "30",
     "several nodes: a launcher silent this long is lost,\n"
     "and its job stops (default {default})",
     read_seconds<&LaunchOptions::heartbeat_timeout, Zero::kRefused>},
    {"log_dir", 0, "DIR", nullptr, "DIR/attempt_<k>/<rank>/{stdout,stderr}.log",
     [](CommandLine& line, const std::string& flag, const std::string& value) {
       if (value.empty()) throw InvalidArgument(fmt::format("{}: expected a directory, found ''", flag));
       line.options.log_dir = value;
     }},
    {"redirects", 'r', "0-3|R:V,...", "0", "streams to files: 1 stdout, 2 stderr, 3 both",
     read_streams<&LaunchOptions::redirects>},
    {"tee", 't', "0-3|R:V,...", "0",
     "like --redirects and also to the console, with a\n"
     "[rank<N>]: prefix",
     read_streams<&LaunchOptions::tee>},
    {"local_ranks_filter", 0, "R,...", nullptr, "only these local ranks print to the console",
     read_later<&DependentFlags::local_ranks_filter>},
    {"role", 0, "NAME", "default", "ROLE_NAME for the workers (default \"{default}\")",
     [](CommandLine& line, const std::string& flag, const std::string& value) {
       if (value.empty()) throw InvalidArgument(fmt::format("{}: expected a non-empty name", flag));
       line.options.role = value;
     }},
    {"cpu_bind", 0, "none|cores", "none",
     "cores: each worker runs on its own equal share of\n"
     "this launcher's CPUs, and OMP_NUM_THREADS defaults to\n"
     "the share's size (like mpirun --bind-to core).\n"
     "Default {default}",
     [](CommandLine& line, const std::string& flag, const std::string& value) {
       if (value == "cores") {
         line.options.cpu_bind = CpuBind::kCores;
       } else if (value != "none") {
         throw InvalidArgument(fmt::format("{}: expected 'none' or 'cores', found '{}'", flag, value));
       }
     }},
    {"no_python", 0, nullptr, nullptr,
     "run a .py program directly (by its #! line), not\n"
     "under the Python interpreter",
     [](CommandLine& line, const std::string&, const std::string&) { line.options.no_python = true; }},
    {"module", 'm', nullptr, nullptr, "the program is a Python module: python -m PROGRAM",
     [](CommandLine& line, const std::string&, const std::string&) { line.options.module = true; }},
    {"run_path", 0, nullptr, nullptr, "run the .py program through runpy.run_path",
     [](CommandLine& line, const std::string&, const std::string&) { line.options.run_path = true; }},
    {"rdzv_conf", 0, "KEY=VALUE,...", nullptr,
     "torchrun's rendezvous settings: join_timeout,\n"
     "last_call_timeout, is_host, keep_alive_interval, ...\n"
     "(docs/launcher.md)",
     read_later<&DependentFlags::rdzv_conf>},
    {"local_addr", 0, "ADDR", nullptr,
     "node 0: the address its workers get as MASTER_ADDR\n"
     "(default: the one that reaches the store)",
     [](CommandLine& line, const std::string& flag, const std::string& value) {
       if (value.empty()) throw InvalidArgument(fmt::format("{}: expected an address of this node, found ''", flag));
       line.options.local_addr = value;
     }},
    {"signals_to_handle", 0, "SIG,...", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
     "signals the launcher catches (see docs); any other\n"
     "keeps its default action",
     [](CommandLine& line, const std::string& flag, const std::string& value) {
       line.options.signals_to_handle = parse_signal_list(value, flag);
     }},
    {"start_method", 0, "METHOD", "spawn",
     "spawn|fork|forkserver: accepted for torchrun's sake,\n"
     "no effect: workers always start by fork and exec",
     [](CommandLine&, const std::string& flag, const std::string& value) {
       if (value != "spawn" && value != "fork" && value != "forkserver") {
         throw InvalidArgument(
             fmt::format("{}: expected 'spawn', 'fork' or 'forkserver', found '{}'", flag, value));
       }
     }},
    {"event_log_handler", 0, "null", "null", "accepted for torchrun's sake: only 'null'",
     [](CommandLine&, const std::string& flag, const std::string& value) {
       if (value != "null") {
         throw InvalidArgument(fmt::format(
             "{} {}: mtrain-launch has no event handlers to load; its events are its log lines "
             "and the failure report (expected 'null')",
             flag, value));
       }
     }},
    {"logs_specs", 0, "NAME", nullptr, "refused: there are no log plugins (docs/launcher.md)",
     refuse<kNoLogPlugins>},
    {"numa_binding", 0, "MODE", nullptr, "refused: use --cpu_bind cores", refuse<kNoNumaBinding>},
    {"help", 'h', nullptr, nullptr, "this text", read_nothing},
};

// torchrun takes every flag's default from PET_<FLAG> (its argparse `env` actions),
// except these, which have no such action there.
constexpr const char* kNoEnvironmentDefault[] = {"help", "logs_specs", "numa_binding"};

const Flag* find_flag(const std::string& name) {
  for (const Flag& flag : kFlags) {
    if (name == flag.name) return &flag;
  }
  return nullptr;
}

// argparse accepts an unambiguous prefix of a long option (--nproc=2), and so does the
// launcher; an ambiguous one is an error naming the candidates.
const Flag* find_flag_by_prefix(const std::string& prefix, const std::string& arg) {
  std::vector<const Flag*> matches;
  for (const Flag& flag : kFlags) {
    if (std::string_view(flag.name).substr(0, prefix.size()) == prefix) matches.push_back(&flag);
  }
  if (matches.size() <= 1) return matches.empty() ? nullptr : matches.front();
  std::string names;
  for (const Flag* flag : matches) names += fmt::format("{}--{}", names.empty() ? "" : ", ", flag->name);
  throw InvalidArgument(fmt::format("ambiguous option '{}': it could be {}", arg, names));
}

std::string name_of_alias(char alias) {
  for (const Flag& flag : kFlags) {
    if (flag.alias != 0 && flag.alias == alias) return flag.name;
  }
  return {};
}

bool takes_value(const Flag& flag) { return flag.value != nullptr; }

std::string help_of(const Flag& flag) {
  std::string text = flag.help;
  constexpr std::string_view kDefault = "{default}";
  if (const size_t at = text.find(kDefault); at != std::string::npos) {
    MTRAIN_CHECK(flag.default_value != nullptr, "--{} shows a default it does not have", flag.name);
    text.replace(at, kDefault.size(), flag.default_value);
  }
  return text;
}

// "  --name VALUE  help", the help in a column of its own. The flag and its value must
// fit in kHelpColumn - 4 characters.
constexpr size_t kHelpColumn = 35;

std::string usage_entry(const Flag& flag) {
  std::string spelling = flag.alias != 0 ? fmt::format("-{}, --{}", flag.alias, flag.name)
                                         : fmt::format("--{}", flag.name);
  if (takes_value(flag)) spelling += fmt::format(" {}", flag.value);
  std::string entry;
  for (const std::string& line : split(help_of(flag), '\n')) {
    entry += fmt::format("  {:<{}}{}\n", entry.empty() ? spelling : "", kHelpColumn - 2, line);
  }
  return entry;
}

// split_launcher_args() has checked the names and which flags take a value; cxxopts
// reads the values, and the table's defaults for flags that are absent.
cxxopts::Options flag_spec() {
  cxxopts::Options spec("mtrain-launch");
  auto add = spec.add_options();
  for (const Flag& flag : kFlags) {
    if (!takes_value(flag)) {
      add(flag.name, help_of(flag));
    } else if (flag.default_value == nullptr) {
      add(flag.name, help_of(flag), cxxopts::value<std::string>());
    } else {
      add(flag.name, help_of(flag), cxxopts::value<std::string>()->default_value(flag.default_value));
    }
  }
  return spec;
}

cxxopts::ParseResult parse_flags(cxxopts::Options& spec, const std::vector<std::string>& launcher_args) {
  std::vector<const char*> argv{"mtrain-launch"};
  for (const auto& a : launcher_args) argv.push_back(a.c_str());
  try {
    return spec.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const cxxopts::exceptions::exception& e) {
    throw InvalidArgument(e.what());
  }
}

std::string environment_name(const Flag& flag) {
  std::string name = std::string("PET_") + flag.name;
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
  return name;
}

std::optional<std::string> environment_default(const Flag& flag) {
  for (const char* name : kNoEnvironmentDefault) {
    if (std::string_view(name) == flag.name) return std::nullopt;
  }
  return env::get(environment_name(flag).c_str());
}

// Each flag from the command line, else from PET_<FLAG>, else its default.
CommandLine read_flags(const cxxopts::ParseResult& given) {
  CommandLine line;
  for (const Flag& flag : kFlags) {
    const std::string dashed = fmt::format("--{}", flag.name);
    if (given.count(flag.name) != 0) {
      line.given.insert(flag.name);
      flag.read(line, dashed, takes_value(flag) ? given[flag.name].as<std::string>() : "");
    } else if (const auto value = environment_default(flag)) {
      const std::string label = fmt::format("{} (from {})", dashed, environment_name(flag));
      line.from_environment.push_back(fmt::format("{}={}", environment_name(flag), *value));
      // A switch is on when its variable holds a non-zero integer (torchrun's check_env).
      if (!takes_value(flag) && env::parse_int(*value, label + ", an integer: 0 off, others on") == 0) continue;
      line.given.insert(flag.name);
      flag.read(line, label, *value);
    } else if (flag.default_value != nullptr) {
      flag.read(line, dashed, flag.default_value);
    }
  }
  return line;
}

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

// --redirects, --tee and --local_ranks_filter name local ranks: each below --nproc_per_node.
void check_local_ranks(CommandLine& line) {
  LaunchOptions& o = line.options;
  for (const auto* sel : {&o.redirects, &o.tee}) {
    for (const auto& [rank, bits] : sel->per_local_rank) {
      if (rank >= o.nproc_per_node) {
        throw InvalidArgument(fmt::format(
            "{}: local rank {} is not below --nproc_per_node {}",
            sel == &o.tee ? "--tee" : "--redirects", rank, o.nproc_per_node));
      }
    }
  }
  if (line.dependent.local_ranks_filter) {
    std::set<int> ranks;
    for (const std::string& item : split(*line.dependent.local_ranks_filter, ',')) {
      ranks.insert(static_cast<int>(env::parse_int(
          item, fmt::format("--local_ranks_filter (local ranks below {})", o.nproc_per_node), 0,
          o.nproc_per_node - 1)));
    }
    o.local_ranks_filter = std::move(ranks);
  }
}

void take_program(const std::vector<std::string>& program_and_args, LaunchOptions& o) {
  if (program_and_args.empty()) {
    throw InvalidArgument("expected a program to run after the options, found none "
                          "(e.g. mtrain-launch --nproc_per_node=2 train --model mlp)");
  }
  o.program = program_and_args.front();
  if (o.program.empty()) throw InvalidArgument("expected a program to run, found ''");
  o.program_args.assign(program_and_args.begin() + 1, program_and_args.end());
  // torchrun refuses --module with --no_python and lets --run_path win over --no_python
  // (resolve_command says so); a module and a path at once is a contradiction here.
  if (o.no_python && o.module && !o.run_path) {
    throw InvalidArgument("--no_python and --module contradict each other: --module runs the program under the "
                          "Python interpreter");
  }
  if (o.module && o.run_path) throw InvalidArgument("--module and --run_path: choose one way to run the program");
}

}  // namespace

int StreamSelection::for_local_rank(int local_rank) const {
  if (!per_rank) return all;
  const auto it = per_local_rank.find(local_rank);
  return it == per_local_rank.end() ? 0 : it->second;
}

bool StreamSelection::any() const {
  if (!per_rank) return all != 0;
  return std::any_of(per_local_rank.begin(), per_local_rank.end(),
                     [](const auto& kv) { return kv.second != 0; });
}

// Note [Launcher command line]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cxxopts cannot stop at the first positional argument, so split_launcher_args() first
// finds where the program starts, knowing from kFlags which flags take a value, and
// normalises the launcher's part to underscores (both spellings are accepted, as torchrun
// does) and unambiguous prefixes to the full name (argparse's allow_abbrev) before cxxopts
// reads it. read_flags() then takes each flag from the command line, else from the
// variable PET_<FLAG> (PET_NPROC_PER_NODE=2; a switch is on for a non-zero integer), else
// from its default, as torchrun's argparse actions do.

SplitArgs split_launcher_args(const std::vector<std::string>& args) {
  SplitArgs out;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // the program starts here

    std::string name;
    std::optional<std::string> value;
    if (arg[1] == '-') {
      const size_t eq = arg.find('=');
      name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      std::replace(name.begin(), name.end(), '-', '_');
      if (eq != std::string::npos) value = arg.substr(eq + 1);
    } else {
      name = name_of_alias(arg[1]);
      if (arg.size() > 2) value = arg.substr(arg[2] == '=' ? 3 : 2);
    }
    const Flag* flag = name.empty() ? nullptr : find_flag(name);
    if (flag == nullptr && arg[1] == '-' && !name.empty()) flag = find_flag_by_prefix(name, arg);
    if (flag != nullptr) name = flag->name;
    if (flag == nullptr) {
      throw InvalidArgument(fmt::format(
          "unknown option '{}' (launcher options go before the program; put '--' before a "
          "program whose name starts with '-'; see --help)",
          arg));
    }
    if (takes_value(*flag) && !value) {
      if (i + 1 >= args.size()) {
        throw InvalidArgument(fmt::format("--{}: expected a value, found the end of the "
                                          "command line", name));
      }
      value = args[++i];
    }
    if (!takes_value(*flag) && value) {
      throw InvalidArgument(fmt::format("--{} takes no value, found '{}'", name, *value));
    }
    out.launcher_args.push_back(value ? fmt::format("--{}={}", name, *value)
                                      : fmt::format("--{}", name));
  }
  out.program_and_args.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  return out;
}

StreamSelection parse_stream_selection(const std::string& text, const std::string& flag) {
  StreamSelection sel;
  const auto parse_bits = [&](const std::string& v) {
    return static_cast<int>(env::parse_int(v, fmt::format("{} (0 none, 1 stdout, 2 stderr, "
                                                          "3 both)", flag), 0, 3));
  };
  if (text.find(':') == std::string::npos) {
    sel.all = parse_bits(text);
    return sel;
  }
  sel.per_rank = true;
  for (const std::string& item : split(text, ',')) {
    const auto kv = split(item, ':');
    if (kv.size() != 2) {
      throw InvalidArgument(fmt::format(
          "{}: expected 0-3 or LOCAL_RANK:VALUE pairs like '0:3,1:1', found '{}'", flag, text));
    }
    const int rank = static_cast<int>(env::parse_int(kv[0], flag + " local rank", 0, 1 << 20));
    if (!sel.per_local_rank.emplace(rank, parse_bits(kv[1])).second) {
      throw InvalidArgument(fmt::format("{}: local rank {} is listed twice in '{}'", flag,
                                        rank, text));
    }
  }
  return sel;
}

std::set<int> parse_signal_list(const std::string& text, const std::string& flag) {
  constexpr std::pair<const char*, int> kHandleable[] = {{"SIGINT", SIGINT},   {"SIGTERM", SIGTERM},
                                                          {"SIGHUP", SIGHUP},   {"SIGQUIT", SIGQUIT},
                                                          {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2}};
  std::set<int> signals;
  for (std::string item : split(text, ',')) {
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    std::transform(item.begin(), item.end(), item.begin(), [](unsigned char c) { return std::toupper(c); });
    if (item.rfind("SIG", 0) != 0) item = "SIG" + item;
    const auto* found = std::find_if(std::begin(kHandleable), std::end(kHandleable),
                                     [&](const auto& known) { return item == known.first; });
    if (found == std::end(kHandleable)) {
      throw InvalidArgument(fmt::format("{}: expected a comma-separated list of SIGINT, SIGTERM, SIGHUP, SIGQUIT, "
                                        "SIGUSR1, SIGUSR2 (the signals the launcher can handle), found '{}' in '{}'",
                                        flag, item, text));
    }
    signals.insert(found->second);
  }
  return signals;
}

std::pair<int, int> parse_nnodes(const std::string& text) {
  const auto parts = split(text, ':');
  if (parts.size() > 2) {
    throw InvalidArgument(fmt::format("--nnodes: expected N or MIN:MAX, found '{}'", text));
  }
  const int lo = static_cast<int>(env::parse_int(parts[0], "--nnodes", 1, 1 << 20));
  const int hi = parts.size() == 2
                     ? static_cast<int>(env::parse_int(parts[1], "--nnodes MAX", 1, 1 << 20))
                     : lo;
  if (lo > hi) {
    throw InvalidArgument(
        fmt::format("--nnodes: expected MIN <= MAX in MIN:MAX, found '{}'", text));
  }
  return {lo, hi};
}

std::pair<std::string, uint16_t> parse_endpoint(const std::string& text, const std::string& flag,
                                                uint16_t default_port) {
  std::string host;
  std::string port_text;
  if (!text.empty() && text.front() == '[') {  // [v6]:port
    const size_t close = text.find(']');
    if (close == std::string::npos) {
      throw InvalidArgument(fmt::format("{}: expected [ADDRESS]:PORT, found '{}'", flag, text));
    }
    host = text.substr(1, close - 1);
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') {
        throw InvalidArgument(fmt::format("{}: expected [ADDRESS]:PORT, found '{}'", flag, text));
      }
      port_text = text.substr(close + 2);
    }
  } else {
    const size_t colon = text.rfind(':');
    if (colon != std::string::npos && text.find(':') != colon) {
      host = text;  // bare IPv6 address without a port
    } else {
      host = text.substr(0, colon);
      if (colon != std::string::npos) port_text = text.substr(colon + 1);
    }
  }
  if (host.empty()) {
    throw InvalidArgument(fmt::format("{}: expected HOST:PORT, found '{}'", flag, text));
  }
  const uint16_t port =
      port_text.empty() ? default_port
                        : static_cast<uint16_t>(env::parse_int(port_text, flag + " port", 0, 65535));
  return {host, port};
}

int count_visible_gpus() {
  // The driver lists one directory per GPU here; reading it needs no CUDA library, so
  // the launcher stays free of CUDA (it runs on CPU-only hosts and must start fast).
  int devices = 0;
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
    (void)entry;
    ++devices;
  }
  const auto visible = env::get("CUDA_VISIBLE_DEVICES");
  if (!visible) return devices;
  // CUDA stops at the first invalid entry; an empty value hides every device.
  int listed = 0;
  for (const std::string& item : split(*visible, ',')) {
    if (item.empty()) break;
    ++listed;
  }
  return std::min(devices, listed);
}

int parse_nproc_per_node(const std::string& text, const std::string& flag) {
  if (text == "cpu") return count_usable_cpus();
  if (text == "gpu" || text == "auto") {
    const int gpus = count_visible_gpus();
    if (gpus > 0) return gpus;
    if (text == "auto") return count_usable_cpus();
    throw InvalidArgument(fmt::format(
        "{} gpu: expected at least one visible NVIDIA GPU, found none "
        "(no entries in /proc/driver/nvidia/gpus{}); pass a number or 'cpu'",
        flag, env::get("CUDA_VISIBLE_DEVICES")
            ? fmt::format(" visible through CUDA_VISIBLE_DEVICES='{}'",
                          *env::get("CUDA_VISIBLE_DEVICES"))
            : ""));
  }
  return static_cast<int>(env::parse_int(
      text, flag + " (a number >= 1, or cpu, gpu, auto)", 1, 1 << 16));
}

std::string usage() {
  std::string text = R"(usage: mtrain-launch [options] PROGRAM [ARGS...]

Starts --nproc_per_node workers of PROGRAM on this node (and joins other nodes), gives
each one torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...),
tears the whole gang down on the first failure and prints the root cause.
PROGRAM is `train` (the sibling mtrain-train), `bench` (mtrain-bench), a Python
script (script.py, or a module with -m), or any executable path or name on PATH; ARGS
are passed through untouched. Every option also accepts the dashed spelling
(--nproc-per-node) and an unambiguous prefix (--nproc=2). Full guide: docs/launcher.md.

options:
)";
  for (const Flag& flag : kFlags) text += usage_entry(flag);
  text += R"(
environment: PET_<OPTION> (PET_NPROC_PER_NODE=2) is the default of an option that
is not given, as in torchrun. MTRAIN_STORE_TOKEN: the store's job token (required with
several nodes, except a dynamic rendezvous on loopback; generated otherwise).
MTRAIN_PYTHON (or PYTHON_EXEC): the Python for .py programs (default: python3 on PATH).
)";
  return text;
}

ParsedCommandLine parse_command_line(const std::vector<std::string>& args) {
  const SplitArgs split_args = split_launcher_args(args);
  cxxopts::Options spec = flag_spec();
  const cxxopts::ParseResult given = parse_flags(spec, split_args.launcher_args);
  ParsedCommandLine parsed;
  if (given.count("help")) {
    parsed.help = true;
    return parsed;
  }
  CommandLine line = read_flags(given);
  try {
    apply_rdzv_conf(line);
    resolve_rendezvous(line, parsed.ignored);
    check_local_ranks(line);
  } catch (const InvalidArgument& e) {
    if (line.from_environment.empty()) throw;
    // These checks name flags; say which of them came from the environment.
    std::string vars;
    for (const std::string& v : line.from_environment) vars += (vars.empty() ? "" : ", ") + v;
    throw InvalidArgument(fmt::format("{} (flags taken from the environment: {})", e.what(), vars));
  }
  parsed.options = std::move(line.options);
  take_program(split_args.program_and_args, parsed.options);
  return parsed;
}

}  // namespace mtrain::launch
