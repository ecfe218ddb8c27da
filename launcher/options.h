// mtrain-launch's command line: parsing and validation into LaunchOptions.
//
// Everything before the program belongs to the launcher; the program and everything
// after it reach the workers untouched, even when they look like flags
// (`mtrain-launch --nproc_per_node=3 sh -c '...'`), and `--` ends the launcher's part
// explicitly. Every flag has an underscore and a dash spelling (`--nproc_per_node`,
// `--nproc-per-node`). The flags are the rows of kFlags in options.cpp: --help, the
// parser and the defaults all come from there (Note [Launcher command line]).
#pragma once

#include <chrono>
#include <csignal>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "launcher/cpu_binding.h"

namespace mtrain::launch {

using Seconds = std::chrono::duration<double>;

// Which of a worker's streams go to a file: bit 1 = stdout, bit 2 = stderr (torchrun's
// encoding: 0 none, 1 stdout, 2 stderr, 3 both). One value for every local rank, or
// per local rank ("0:3,1:1"; ranks not listed get 0).
struct StreamSelection {
  int all = 0;
  std::map<int, int> per_local_rank;
  bool per_rank = false;

  int for_local_rank(int local_rank) const;
  bool any() const;
  bool operator==(const StreamSelection&) const = default;
};

inline constexpr int kStdoutBit = 1;
inline constexpr int kStderrBit = 2;

enum class RendezvousMode {
  kStatic,   // --nnodes N --node_rank R --master_addr --master_port
  kDynamic,  // --rdzv_endpoint HOST:PORT --rdzv_id ID --nnodes MIN:MAX
};

inline constexpr uint16_t kDefaultMasterPort = 29500;  // torchrun's
inline constexpr uint16_t kDefaultRdzvPort = 29400;    // torchrun's c10d default

struct LaunchOptions {
  int nproc_per_node = 1;
  int min_nodes = 1;
  int max_nodes = 1;
  int node_rank = 0;  // static only; dynamic ranks come from join order

  RendezvousMode mode = RendezvousMode::kStatic;
  // Where the agents' store lives. Static: --master_addr/--master_port (the address
  // node 0 binds and everyone dials). Dynamic: --rdzv_endpoint. Port 0 = pick a free
  // port (single node only).
  std::string store_host = "127.0.0.1";
  uint16_t store_port = 0;
  std::string rdzv_id = "none";
  bool standalone = false;

  int max_restarts = 0;
  Seconds monitor_interval{0.1};
  Seconds term_timeout{30.0};
  // Several nodes: a node whose launcher has not been heard from for this long is lost
  // (Note [Agent heartbeats] in heartbeats.cpp); also the longest one store request may take.
  Seconds heartbeat_timeout{30.0};
  Seconds rdzv_timeout{120.0};
  Seconds rdzv_last_call{3.0};

  std::optional<std::string> log_dir;
  StreamSelection redirects;
  StreamSelection tee;
  std::optional<std::set<int>> local_ranks_filter;  // nullopt = every local rank
  std::string role = "default";
  CpuBind cpu_bind = CpuBind::kNone;  // Note [Binding workers to CPUs] (cpu_binding.cpp)

  std::string program;                    // as given: "train", "./a.out", "sh", "train.py", a module
  std::vector<std::string> program_args;  // passed through untouched
  // How the program runs (Note [Programs as torchrun runs them] in program.cpp): -m runs
  // a Python module, --run_path a script through runpy; --no_python runs a .py directly.
  bool module = false;
  bool run_path = false;
  bool no_python = false;

  // --rdzv_conf is_host (dynamic): true hosts the store or fails, false only joins it;
  // nullopt: the agent that can bind the endpoint hosts it.
  std::optional<bool> rdzv_is_host;
  // --local_addr: the address node 0 gives its workers as MASTER_ADDR (Note [Worker
  // rendezvous for other frameworks] in attempt.cpp); nullopt: the one that reaches the store.
  std::optional<std::string> local_addr;
  // --signals_to_handle: the signals the launcher catches (docs/launcher.md, "Signals");
  // the others keep their default action.
  std::set<int> signals_to_handle = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

  bool multi_node() const { return max_nodes > 1; }
  bool operator==(const LaunchOptions&) const = default;
};

// The launcher's own arguments and the program with its arguments.
struct SplitArgs {
  std::vector<std::string> launcher_args;  // normalised to underscores
  std::vector<std::string> program_and_args;
};
SplitArgs split_launcher_args(const std::vector<std::string>& args);

struct ParsedCommandLine {
  bool help = false;  // --help was given: print usage() and exit 0
  LaunchOptions options;
  // Valid flags the chosen mode overrides (--standalone picks its own store), one
  // sentence each, for the launcher to log as warnings.
  std::vector<std::string> ignored;
};

// `args` excludes argv[0]. A flag absent from `args` takes its value from the variable
// PET_<FLAG> when set, as torchrun's do (Note [Launcher command line]). Throws
// InvalidArgument with a one-line message naming the flag (and the variable), what was
// expected and what was found.
ParsedCommandLine parse_command_line(const std::vector<std::string>& args);

std::string usage();

// Pieces exposed for unit tests.
StreamSelection parse_stream_selection(const std::string& text, const std::string& flag);
// "SIGTERM,SIGUSR1" (names with or without SIG, any case) -> their numbers; only the
// signals the launcher can handle (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2).
std::set<int> parse_signal_list(const std::string& text, const std::string& flag);
// "N" -> {N, N}; "MIN:MAX" -> {MIN, MAX}.
std::pair<int, int> parse_nnodes(const std::string& text);
// "host:port", "host" (default_port), "[v6addr]:port".
std::pair<std::string, uint16_t> parse_endpoint(const std::string& text, const std::string& flag,
                                                uint16_t default_port);
// N, or "cpu" (CPUs this process may run on), "gpu" (NVIDIA GPUs visible), "auto"
// (GPUs if any, else CPUs).
int parse_nproc_per_node(const std::string& text, const std::string& flag = "--nproc_per_node");
// GPUs the driver exposes (/proc/driver/nvidia/gpus), narrowed by CUDA_VISIBLE_DEVICES.
int count_visible_gpus();

}  // namespace mtrain::launch
