#include "launcher/options.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cxxopts.hpp>
#include <filesystem>

#include "core/env.h"
#include "core/error.h"

namespace mtrain::launch {
namespace {

struct FlagInfo {
  const char* name;  // underscore spelling
  bool takes_value;
};

// Every launcher flag; split_launcher_args() needs to know which ones take a value to
// find where the program starts (Note [Launcher command line]).
constexpr FlagInfo kFlags[] = {
    {"nproc_per_node", true}, {"nnodes", true},         {"node_rank", true},
    {"master_addr", true},    {"master_port", true},    {"rdzv_endpoint", true},
    {"rdzv_id", true},        {"rdzv_backend", true},   {"rdzv_timeout", true},
    {"rdzv_last_call", true}, {"standalone", false},    {"max_restarts", true},
    {"monitor_interval", true}, {"term_timeout", true}, {"heartbeat_timeout", true},
    {"log_dir", true},
    {"redirects", true},      {"tee", true},            {"local_ranks_filter", true},
    {"role", true},           {"cpu_bind", true},       {"no_python", false},
    {"help", false},
};

const FlagInfo* find_flag(const std::string& name) {
  for (const auto& f : kFlags) {
    if (name == f.name) return &f;
  }
  return nullptr;
}

std::string short_to_long(char c) {
  switch (c) {
    case 'r': return "redirects";
    case 't': return "tee";
    case 'h': return "help";
    default: return {};
  }
}

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
      name = short_to_long(arg[1]);
      if (arg.size() > 2) value = arg.substr(arg[2] == '=' ? 3 : 2);
    }
    const FlagInfo* flag = name.empty() ? nullptr : find_flag(name);
    if (flag == nullptr) {
      throw InvalidArgument(fmt::format(
          "unknown option '{}' (launcher options go before the program; put '--' before a "
          "program whose name starts with '-'; see --help)",
          arg));
    }
    if (flag->takes_value && !value) {
      if (i + 1 >= args.size()) {
        throw InvalidArgument(fmt::format("--{}: expected a value, found the end of the "
                                          "command line", name));
      }
      value = args[++i];
    }
    if (!flag->takes_value && value) {
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

int parse_nproc_per_node(const std::string& text) {
  if (text == "cpu") return count_usable_cpus();
  if (text == "gpu" || text == "auto") {
    const int gpus = count_visible_gpus();
    if (gpus > 0) return gpus;
    if (text == "auto") return count_usable_cpus();
    throw InvalidArgument(fmt::format(
        "--nproc_per_node gpu: expected at least one visible NVIDIA GPU, found none "
        "(no entries in /proc/driver/nvidia/gpus{}); pass a number or 'cpu'",
        env::get("CUDA_VISIBLE_DEVICES")
            ? fmt::format(" visible through CUDA_VISIBLE_DEVICES='{}'",
                          *env::get("CUDA_VISIBLE_DEVICES"))
            : ""));
  }
  return static_cast<int>(env::parse_int(
      text, "--nproc_per_node (a number >= 1, or cpu, gpu, auto)", 1, 1 << 16));
}

std::string usage() {
  return R"(usage: mtrain-launch [options] PROGRAM [ARGS...]

Starts --nproc_per_node workers of PROGRAM on this node (and joins other nodes), gives
each one torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...),
tears the whole gang down on the first failure and prints the root cause.
PROGRAM is `train` (the sibling mtrain-train), `bench` (mtrain-bench), or any
executable path or name on PATH; ARGS are passed through untouched. Every option
also accepts the dashed spelling (--nproc-per-node). Full guide: docs/launcher.md.

options:
  --nproc_per_node N|cpu|gpu|auto  workers on this node (default 1)
  --nnodes N|MIN:MAX               nodes in the job (MIN:MAX needs --rdzv_endpoint)
  --node_rank R                    this node's rank, static rendezvous (default 0)
  --master_addr ADDR               static: address node 0's store binds and every node
                                   dials (default 127.0.0.1)
  --master_port PORT               static: store port; 0 = a free port (single node
                                   only). Default: free port on one node, 29500 on many
  --rdzv_endpoint HOST[:PORT]      dynamic rendezvous store (default port 29400); the
                                   agent that can bind it hosts the store
  --rdzv_id ID                     job id shared by every node (default "none")
  --rdzv_backend static|c10d       torchrun compatibility; c10d = dynamic
  --rdzv_timeout S                 seconds to wait for the other nodes (default 120)
  --rdzv_last_call S               dynamic, MIN < MAX: seconds to wait for more nodes
                                   once MIN have joined (default 3)
  --standalone                     one node, a free port on 127.0.0.1, a random run id
  --max_restarts K                 restart the whole gang up to K times (default 0)
  --monitor_interval S             how often to look for other nodes' failures (0.1)
  --term_timeout S                 grace between SIGTERM and SIGKILL (default 30)
  --heartbeat_timeout S            several nodes: a launcher silent this long is lost,
                                   and its job stops (default 30)
  --log_dir DIR                    DIR/attempt_<k>/<rank>/{stdout,stderr}.log
  -r, --redirects 0-3|R:V,...      streams to files: 1 stdout, 2 stderr, 3 both
  -t, --tee 0-3|R:V,...            like --redirects and also to the console, with a
                                   [rank<N>]: prefix
  --local_ranks_filter R,...       only these local ranks print to the console
  --role NAME                      ROLE_NAME for the workers (default "default")
  --cpu_bind none|cores            cores: each worker runs on its own equal share of
                                   this launcher's CPUs, and OMP_NUM_THREADS defaults to
                                   the share's size (like mpirun --bind-to core).
                                   Default none
  --no_python                      accepted for torchrun compatibility (always true)
  -h, --help                       this text

environment: MTRAIN_STORE_TOKEN (the store's job token; required with several
nodes, generated otherwise).
)";
}

ParsedCommandLine parse_command_line(const std::vector<std::string>& args) {
  const SplitArgs split_args = split_launcher_args(args);

  cxxopts::Options spec("mtrain-launch");
  spec.add_options()
      ("nproc_per_node", "", cxxopts::value<std::string>()->default_value("1"))
      ("nnodes", "", cxxopts::value<std::string>()->default_value("1"))
      ("node_rank", "", cxxopts::value<std::string>())
      ("master_addr", "", cxxopts::value<std::string>())
      ("master_port", "", cxxopts::value<std::string>())
      ("rdzv_endpoint", "", cxxopts::value<std::string>())
      ("rdzv_id", "", cxxopts::value<std::string>())
      ("rdzv_backend", "", cxxopts::value<std::string>())
      ("rdzv_timeout", "", cxxopts::value<std::string>()->default_value("120"))
      ("rdzv_last_call", "", cxxopts::value<std::string>()->default_value("3"))
      ("standalone", "")
      ("max_restarts", "", cxxopts::value<std::string>()->default_value("0"))
      ("monitor_interval", "", cxxopts::value<std::string>()->default_value("0.1"))
      ("term_timeout", "", cxxopts::value<std::string>()->default_value("30"))
      ("heartbeat_timeout", "", cxxopts::value<std::string>()->default_value("30"))
      ("log_dir", "", cxxopts::value<std::string>())
      ("redirects", "", cxxopts::value<std::string>()->default_value("0"))
      ("tee", "", cxxopts::value<std::string>()->default_value("0"))
      ("local_ranks_filter", "", cxxopts::value<std::string>())
      ("role", "", cxxopts::value<std::string>()->default_value("default"))
      ("cpu_bind", "", cxxopts::value<std::string>()->default_value("none"))
      ("no_python", "")
      ("help", "");

  std::vector<const char*> argv{"mtrain-launch"};
  for (const auto& a : split_args.launcher_args) argv.push_back(a.c_str());
  cxxopts::ParseResult r;
  try {
    r = spec.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const cxxopts::exceptions::exception& e) {
    throw InvalidArgument(e.what());
  }

  ParsedCommandLine parsed;
  if (r.count("help")) {
    parsed.help = true;
    return parsed;
  }
  LaunchOptions& o = parsed.options;
  const auto str = [&](const char* name) { return r[name].as<std::string>(); };

  o.nproc_per_node = parse_nproc_per_node(str("nproc_per_node"));
  std::tie(o.min_nodes, o.max_nodes) = parse_nnodes(str("nnodes"));
  o.max_restarts = static_cast<int>(env::parse_int(str("max_restarts"), "--max_restarts", 0,
                                                   1 << 20));
  o.monitor_interval = Seconds(parse_seconds(str("monitor_interval"), "--monitor_interval", false));
  o.term_timeout = Seconds(parse_seconds(str("term_timeout"), "--term_timeout", true));
  o.heartbeat_timeout = Seconds(parse_seconds(str("heartbeat_timeout"), "--heartbeat_timeout", false));
  o.rdzv_timeout = Seconds(parse_seconds(str("rdzv_timeout"), "--rdzv_timeout", false));
  o.rdzv_last_call = Seconds(parse_seconds(str("rdzv_last_call"), "--rdzv_last_call", true));
  o.role = str("role");
  if (o.role.empty()) throw InvalidArgument("--role: expected a non-empty name");
  o.standalone = r.count("standalone") > 0;
  if (const std::string bind = str("cpu_bind"); bind == "cores") {
    o.cpu_bind = CpuBind::kCores;
  } else if (bind != "none") {
    throw InvalidArgument(fmt::format("--cpu_bind: expected 'none' or 'cores', found '{}'", bind));
  }

  // Rendezvous mode: an endpoint (or --rdzv_backend c10d) means dynamic.
  std::string backend = r.count("rdzv_backend") ? str("rdzv_backend") : "";
  if (r.count("rdzv_backend") && backend != "static" && backend != "c10d") {
    throw InvalidArgument(
        fmt::format("--rdzv_backend: expected 'static' or 'c10d', found '{}'", backend));
  }
  const bool has_endpoint = r.count("rdzv_endpoint") > 0;
  if (backend == "static" && has_endpoint) {
    throw InvalidArgument("--rdzv_endpoint belongs to the dynamic rendezvous "
                          "(--rdzv_backend c10d); the static one uses --master_addr and "
                          "--master_port");
  }
  if (backend == "c10d" && !has_endpoint && !o.standalone) {
    throw InvalidArgument("--rdzv_backend c10d: expected --rdzv_endpoint HOST:PORT, found none");
  }

  if (o.standalone) {
    if (o.max_nodes != 1) {
      throw InvalidArgument(fmt::format(
          "--standalone runs a single node, found --nnodes {}", str("nnodes")));
    }
    // As torchrun, --standalone overrides the rendezvous flags; they are still checked,
    // so that a typo is not hidden until the flag is used without --standalone.
    if (r.count("master_addr") && str("master_addr").empty()) {
      throw InvalidArgument("--master_addr: expected an address, found ''");
    }
    if (r.count("master_port")) env::parse_int(str("master_port"), "--master_port", 0, 65535);
    if (has_endpoint) parse_endpoint(str("rdzv_endpoint"), "--rdzv_endpoint", kDefaultRdzvPort);
    if (r.count("rdzv_id") && str("rdzv_id").empty()) throw InvalidArgument("--rdzv_id: expected a non-empty job id");
    for (const char* flag : {"master_addr", "master_port", "rdzv_endpoint", "rdzv_backend", "rdzv_id"}) {
      if (r.count(flag)) {
        parsed.ignored.push_back(fmt::format(
            "--{} {} is ignored: --standalone runs its own store on 127.0.0.1 at a free port with a random "
            "run id",
            flag, str(flag)));
      }
    }
    o.mode = RendezvousMode::kStatic;
    o.store_host = "127.0.0.1";
    o.store_port = 0;
    o.rdzv_id.clear();  // the agent draws a random one
  } else if (has_endpoint) {
    o.mode = RendezvousMode::kDynamic;
    std::tie(o.store_host, o.store_port) =
        parse_endpoint(str("rdzv_endpoint"), "--rdzv_endpoint", kDefaultRdzvPort);
    if (o.multi_node() && o.store_port == 0) {
      throw InvalidArgument("--rdzv_endpoint: port 0 cannot be used with several nodes "
                            "(every node must know the port in advance); give a fixed port");
    }
    if (r.count("master_addr") || r.count("master_port")) {
      throw InvalidArgument("--master_addr/--master_port belong to the static rendezvous; "
                            "with --rdzv_endpoint the store lives at the endpoint");
    }
  } else {
    if (o.min_nodes != o.max_nodes) {
      throw InvalidArgument(fmt::format(
          "--nnodes {}: MIN:MAX needs the dynamic rendezvous (--rdzv_endpoint HOST:PORT "
          "--rdzv_id ID); the static one needs a fixed node count",
          str("nnodes")));
    }
    o.mode = RendezvousMode::kStatic;
    if (r.count("master_addr")) o.store_host = str("master_addr");
    if (o.store_host.empty()) throw InvalidArgument("--master_addr: expected an address, found ''");
    if (r.count("master_port")) {
      o.store_port = static_cast<uint16_t>(
          env::parse_int(str("master_port"), "--master_port", 0, 65535));
      if (o.multi_node() && o.store_port == 0) {
        throw InvalidArgument("--master_port 0 (a free port) works only on a single node: "
                              "the other nodes could not know the port; give a fixed port");
      }
    } else {
      o.store_port = o.multi_node() ? kDefaultMasterPort : 0;
    }
  }
  if (r.count("rdzv_id") && !o.standalone) o.rdzv_id = str("rdzv_id");
  if (!o.standalone && o.rdzv_id.empty()) {
    throw InvalidArgument("--rdzv_id: expected a non-empty job id");
  }

  if (r.count("node_rank")) {
    const int64_t node_rank = env::parse_int(str("node_rank"), "--node_rank", 0);
    if (o.mode == RendezvousMode::kStatic) {
      if (node_rank >= o.max_nodes) {
        throw InvalidArgument(fmt::format(
            "--node_rank: expected a rank in [0, {}) for --nnodes {}, found {}", o.max_nodes,
            o.max_nodes, node_rank));
      }
      o.node_rank = static_cast<int>(node_rank);
    }
    // Dynamic: ranks come from join order; a --node_rank left in a script is ignored
    // (the agent says so).
  }

  if (r.count("log_dir")) {
    o.log_dir = str("log_dir");
    if (o.log_dir->empty()) throw InvalidArgument("--log_dir: expected a directory, found ''");
  }
  o.redirects = parse_stream_selection(str("redirects"), "--redirects");
  o.tee = parse_stream_selection(str("tee"), "--tee");
  for (const auto* sel : {&o.redirects, &o.tee}) {
    for (const auto& [rank, bits] : sel->per_local_rank) {
      if (rank >= o.nproc_per_node) {
        throw InvalidArgument(fmt::format(
            "{}: local rank {} is not below --nproc_per_node {}",
            sel == &o.tee ? "--tee" : "--redirects", rank, o.nproc_per_node));
      }
    }
  }
  if (r.count("local_ranks_filter")) {
    std::set<int> ranks;
    for (const std::string& item : split(str("local_ranks_filter"), ',')) {
      ranks.insert(static_cast<int>(env::parse_int(
          item, fmt::format("--local_ranks_filter (local ranks below {})", o.nproc_per_node), 0,
          o.nproc_per_node - 1)));
    }
    o.local_ranks_filter = std::move(ranks);
  }

  if (split_args.program_and_args.empty()) {
    throw InvalidArgument("expected a program to run after the options, found none "
                          "(e.g. mtrain-launch --nproc_per_node=2 train --model mlp)");
  }
  o.program = split_args.program_and_args.front();
  if (o.program.empty()) throw InvalidArgument("expected a program to run, found ''");
  o.program_args.assign(split_args.program_and_args.begin() + 1,
                        split_args.program_and_args.end());
  return parsed;
}

}  // namespace mtrain::launch
