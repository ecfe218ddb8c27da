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
#include "launcher/command_line.h"
#include "launcher/rendezvous_options.h"

namespace mtrain::launch {
namespace {

int count_usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

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
