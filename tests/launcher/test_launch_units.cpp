// The launcher's pure parts: command line, worker environment, error files, root cause
// and report.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include "core/error.h"
#include "launcher/failure_report.h"
#include "launcher/options.h"
#include "launcher/worker_env.h"
#include "launcher/worker_process.h"
#include "tests/launcher/launch_harness.h"

using namespace mtrain;
using namespace mtrain::launch;

namespace {

LaunchOptions parse(std::vector<std::string> args) {
  return parse_command_line(args).options;
}

}  // namespace

TEST_CASE("the program and its arguments are passed through untouched") {
  const auto o = parse({"--nproc-per-node=3", "--max_restarts", "2", "sh", "-c",
                        "echo --nproc_per_node=9", "--tee", "3"});
  CHECK(o.nproc_per_node == 3);
  CHECK(o.max_restarts == 2);
  CHECK(o.program == "sh");
  CHECK(o.program_args == std::vector<std::string>{"-c", "echo --nproc_per_node=9", "--tee", "3"});
  CHECK_FALSE(o.tee.any());

  const auto dashed = parse({"--", "-weird-name", "x"});
  CHECK(dashed.program == "-weird-name");
  CHECK(dashed.program_args == std::vector<std::string>{"x"});

  const auto shorts = parse({"-r", "1", "-t3", "prog"});
  CHECK(shorts.redirects.all == 1);
  CHECK(shorts.tee.all == 3);
  CHECK(parse_command_line({"--help"}).help);
}

TEST_CASE("single-node defaults: a free port on 127.0.0.1, static rendezvous") {
  const auto o = parse({"prog"});
  CHECK(o.mode == RendezvousMode::kStatic);
  CHECK(o.store_host == "127.0.0.1");
  CHECK(o.store_port == 0);
  CHECK(o.nproc_per_node == 1);
  CHECK_FALSE(o.multi_node());
  CHECK(o.term_timeout.count() == 30.0);

  const auto multi = parse({"--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                            "prog"});
  CHECK(multi.store_port == kDefaultMasterPort);
  CHECK(multi.node_rank == 1);
  CHECK(multi.store_host == "10.0.0.1");

  const auto standalone = parse_command_line({"--standalone", "--rdzv_id", "ignored", "--master_port", "29500", "prog"});
  CHECK(standalone.options.store_port == 0);
  CHECK(standalone.options.rdzv_id.empty());  // drawn at random by the agent
  // As torchrun, --standalone overrides them, but says so.
  REQUIRE(standalone.ignored.size() == 2);
  CHECK_THAT(standalone.ignored[0], Catch::Contains("--master_port 29500 is ignored: --standalone"));
  CHECK_THAT(standalone.ignored[1], Catch::Contains("--rdzv_id ignored is ignored"));
  CHECK(parse_command_line({"--standalone", "prog"}).ignored.empty());
  // Overridden, yet still checked.
  CHECK_THROWS_WITH(parse({"--standalone", "--master_port", "abc", "prog"}),
                    Catch::Contains("--master_port") && Catch::Contains("'abc'"));
  CHECK_THROWS_WITH(parse({"--standalone", "--rdzv_endpoint", "h:x", "prog"}), Catch::Contains("--rdzv_endpoint"));
  CHECK_THROWS_WITH(parse({"--standalone", "--master_addr=", "prog"}), Catch::Contains("--master_addr"));
  CHECK_THROWS_WITH(parse({"--standalone", "--rdzv_id=", "prog"}), Catch::Contains("--rdzv_id: expected a non-empty"));
}

TEST_CASE("dynamic rendezvous options") {
  const auto o = parse({"--rdzv_endpoint", "node7:1234", "--rdzv_id", "job", "--nnodes", "2:4",
                        "prog"});
  CHECK(o.mode == RendezvousMode::kDynamic);
  CHECK(o.store_host == "node7");
  CHECK(o.store_port == 1234);
  CHECK(o.min_nodes == 2);
  CHECK(o.max_nodes == 4);
  CHECK(parse({"--rdzv_endpoint", "node7", "prog"}).store_port == kDefaultRdzvPort);
  CHECK(parse_endpoint("[::1]:99", "--x", 1) == std::make_pair(std::string("::1"), uint16_t{99}));

  CHECK_THROWS_WITH(parse({"--nnodes", "1:2", "prog"}), Catch::Contains("--rdzv_endpoint"));
  CHECK_THROWS_WITH(parse({"--nnodes", "3:2", "prog"}), Catch::Contains("MIN <= MAX"));
  CHECK_THROWS_WITH(parse({"--nnodes", "0", "prog"}), Catch::Contains("--nnodes"));
  CHECK_THROWS_WITH(parse({"--rdzv_endpoint", "h:0", "--nnodes", "2", "prog"}),
                    Catch::Contains("port 0"));
  CHECK_THROWS_WITH(parse({"--rdzv_backend", "etcd", "prog"}), Catch::Contains("'etcd'"));
  // Given but empty is not "not given".
  CHECK_THROWS_WITH(parse({"--rdzv_backend", "", "prog"}),
                    Catch::Contains("--rdzv_backend: expected 'static' or 'c10d', found ''"));
  CHECK_THROWS_WITH(parse({"--rdzv_backend", "c10d", "prog"}), Catch::Contains("--rdzv_endpoint"));
}

TEST_CASE("invalid values name the flag and what was found") {
  CHECK_THROWS_AS(parse({"--nproc_per_node", "0", "prog"}), InvalidArgument);
  CHECK_THROWS_WITH(parse({"--nproc_per_node", "abc", "prog"}), Catch::Contains("'abc'"));
  CHECK_THROWS_WITH(parse({"--node_rank", "3", "--nnodes", "3", "prog"}),
                    Catch::Contains("[0, 3)"));
  CHECK_THROWS_WITH(parse({"--term_timeout", "-1", "prog"}), Catch::Contains("--term_timeout"));
  // Past 1e6 s the deadlines would overflow (a "never kill" 1e10 would SIGKILL at once).
  CHECK_THROWS_WITH(parse({"--term_timeout", "1e10", "prog"}),
                    Catch::Contains("--term_timeout: expected a number of seconds >= 0 and at most 1e6, found '1e10'"));
  CHECK_THROWS_WITH(parse({"--monitor_interval", "3e6", "prog"}), Catch::Contains("at most 1e6, found '3e6'"));
  CHECK(parse({"--term_timeout", "1e6", "prog"}).term_timeout.count() == 1e6);
  CHECK(parse({"prog"}).heartbeat_timeout.count() == 30.0);
  CHECK(parse({"--heartbeat_timeout", "2.5", "prog"}).heartbeat_timeout.count() == 2.5);
  CHECK_THROWS_WITH(parse({"--heartbeat_timeout", "0", "prog"}),
                    Catch::Contains("--heartbeat_timeout: expected a number of seconds > 0"));
  CHECK_THROWS_WITH(parse({"--redirects", "4294967296:3", "prog"}), Catch::Contains("local rank"));
  CHECK_THROWS_WITH(parse({"--monitor_interval", "0", "prog"}),
                    Catch::Contains("--monitor_interval"));
  CHECK_THROWS_WITH(parse({"--master_port", "70000", "prog"}), Catch::Contains("--master_port"));
  CHECK_THROWS_WITH(parse({"--tee", "4", "prog"}), Catch::Contains("--tee"));
  CHECK_THROWS_WITH(parse({"--tee", "0:1,0:2", "prog"}), Catch::Contains("listed twice"));
  CHECK_THROWS_WITH(parse({"--nproc_per_node=2", "--tee", "5:1", "prog"}),
                    Catch::Contains("local rank 5"));
  CHECK_THROWS_WITH(parse({"--nproc_per_node=2", "--local_ranks_filter", "0,2", "prog"}),
                    Catch::Contains("--local_ranks_filter"));
  CHECK_THROWS_WITH(parse({"--standalone", "--nnodes", "2", "prog"}), Catch::Contains("single"));
  CHECK_THROWS_WITH(parse({"--nproc_per_node"}), Catch::Contains("expected a value"));
  CHECK_THROWS_WITH(parse({"--standalone=1", "prog"}), Catch::Contains("takes no value"));
}

namespace {

// Sets a variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

}  // namespace

TEST_CASE("PET_<FLAG> is the default of a flag that is not given, as in torchrun") {
  {
    ScopedEnv nproc("PET_NPROC_PER_NODE", "3");
    CHECK(parse({"prog"}).nproc_per_node == 3);
    CHECK(parse({"--nproc_per_node=2", "prog"}).nproc_per_node == 2);  // the command line wins
  }
  {
    ScopedEnv standalone("PET_STANDALONE", "1");
    CHECK(parse({"prog"}).standalone);
  }
  {
    ScopedEnv standalone("PET_STANDALONE", "0");
    CHECK_FALSE(parse({"prog"}).standalone);
  }
  {
    ScopedEnv bad("PET_NPROC_PER_NODE", "two");
    CHECK_THROWS_WITH(parse({"prog"}), Catch::Contains("--nproc_per_node (from PET_NPROC_PER_NODE)") &&
                                           Catch::Contains("'two'"));
  }
  {
    ScopedEnv bad("PET_STANDALONE", "yes");
    CHECK_THROWS_WITH(parse({"prog"}), Catch::Contains("PET_STANDALONE") && Catch::Contains("'yes'"));
  }
  {
    // A check made after every flag is read names the variables that set flags.
    ScopedEnv nnodes("PET_NNODES", "1:2");
    CHECK_THROWS_WITH(parse({"prog"}), Catch::Contains("MIN:MAX needs the dynamic rendezvous") &&
                                           Catch::Contains("flags taken from the environment: PET_NNODES=1:2"));
  }
  {
    ScopedEnv ignored("PET_LOGS_SPECS", "custom");  // torchrun reads no variable for it either
    CHECK_NOTHROW(parse({"prog"}));
  }
}

TEST_CASE("an unambiguous prefix names its flag, as argparse allows") {
  CHECK(parse({"--nproc=2", "prog"}).nproc_per_node == 2);
  CHECK(parse({"--nproc-per", "2", "prog"}).nproc_per_node == 2);
  CHECK(parse({"--max_r", "3", "prog"}).max_restarts == 3);
  CHECK(parse({"--stand", "prog"}).standalone);
  CHECK_THROWS_WITH(parse({"--rdzv", "x", "prog"}),
                    Catch::Contains("ambiguous option '--rdzv'") && Catch::Contains("--rdzv_endpoint") &&
                        Catch::Contains("--rdzv_id"));
  CHECK_THROWS_WITH(parse({"--nope=1", "prog"}), Catch::Contains("unknown option '--nope=1'"));
}

TEST_CASE("--rdzv_conf: torchrun's keys set the launcher's settings, unknown keys are refused") {
  const auto dynamic = [](const std::string& conf) {
    return parse({"--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:29400", "--rdzv_conf", conf, "prog"});
  };
  CHECK(dynamic("join_timeout=7").rdzv_timeout.count() == 7);
  CHECK(dynamic("timeout=9").rdzv_timeout.count() == 9);
  CHECK(dynamic("last_call_timeout=1.5").rdzv_last_call.count() == 1.5);
  CHECK(dynamic("keep_alive_interval=2,keep_alive_max_attempt=4").heartbeat_timeout.count() == 8);
  CHECK(dynamic("keep_alive_interval=2").heartbeat_timeout.count() == 6);  // torchrun's 3 attempts
  CHECK(dynamic("is_host=false").rdzv_is_host == false);
  CHECK(dynamic("is_host=1").rdzv_is_host == true);
  CHECK_FALSE(dynamic("read_timeout=60,close_timeout=30,use_libuv=true,store_type=tcp,rank=0").rdzv_is_host);
  CHECK_THROWS_WITH(dynamic("join_timeout=7,colour=blue"),
                    Catch::Contains("--rdzv_conf: unknown key 'colour'") && Catch::Contains("join_timeout"));
  CHECK_THROWS_WITH(dynamic("is_host=maybe"), Catch::Contains("--rdzv_conf is_host") && Catch::Contains("'maybe'"));
  CHECK_THROWS_WITH(dynamic("join_timeout"), Catch::Contains("with a value for every key"));
  CHECK_THROWS_WITH(dynamic("store_type=file"), Catch::Contains("TCP store"));
  CHECK_THROWS_WITH(parse({"--rdzv_timeout=5", "--rdzv_conf=join_timeout=7", "prog"}),
                    Catch::Contains("contradicts --rdzv_timeout"));
  CHECK(parse({"--rdzv_timeout=7", "--rdzv_conf=join_timeout=7", "prog"}).rdzv_timeout.count() == 7);
  // The static rendezvous has no is_host: node 0 hosts; said, not silently dropped.
  const auto st = parse_command_line({"--rdzv_conf=is_host=true", "prog"});
  CHECK_FALSE(st.options.rdzv_is_host);
  REQUIRE(st.ignored.size() == 1);
  CHECK_THAT(st.ignored.front(), Catch::Contains("is_host=true is ignored"));
}

TEST_CASE("torchrun's other flags: signals, local address, and the ones that mean nothing here") {
  CHECK(parse({"--signals_to_handle=SIGTERM,usr1", "prog"}).signals_to_handle == std::set<int>{SIGTERM, SIGUSR1});
  CHECK_THROWS_WITH(parse({"--signals_to_handle=SIGTERM,SIGKILL", "prog"}),
                    Catch::Contains("'SIGKILL'") && Catch::Contains("SIGUSR2"));
  CHECK(parse({"--local_addr=10.0.0.5", "prog"}).local_addr == "10.0.0.5");
  for (const char* method : {"spawn", "fork", "forkserver"}) CHECK_NOTHROW(parse({"--start_method", method, "prog"}));
  CHECK_THROWS_WITH(parse({"--start_method=thread", "prog"}), Catch::Contains("'thread'"));
  CHECK_NOTHROW(parse({"--event_log_handler=null", "prog"}));
  CHECK_THROWS_WITH(parse({"--event_log_handler=console", "prog"}), Catch::Contains("no event handlers"));
  CHECK_THROWS_WITH(parse({"--logs_specs=mine", "prog"}), Catch::Contains("no log plugins"));
  CHECK_THROWS_WITH(parse({"--numa_binding=node", "prog"}), Catch::Contains("--cpu_bind cores"));
}

TEST_CASE("without flags the options are LaunchOptions' own defaults") {
  // The flag table's defaults (options.cpp) are what a command line gets; the struct's
  // initialisers must say the same.
  LaunchOptions defaults;
  defaults.program = "prog";
  CHECK(parse({"prog"}) == defaults);
}

TEST_CASE("--help lists each flag from its table row: spellings, value, help, default") {
  const std::string text = usage();
  CHECK_THAT(text, Catch::Contains("\n  --nproc_per_node N|cpu|gpu|auto  workers on this node (default 1)\n"));
  CHECK_THAT(text, Catch::Contains("\n  -t, --tee 0-3|R:V,...            like --redirects and also to the console, with a\n"
                                   "                                   [rank<N>]: prefix\n"));
  CHECK_THAT(text, Catch::Contains("\n  --standalone                     one node,"));
  CHECK_THAT(text, Catch::Contains("(like mpirun --bind-to core).\n                                   Default none\n"));
  CHECK_THAT(text, Catch::Contains("\n  -h, --help                       this text\n"));
}

TEST_CASE("stream selections follow torchrun's encoding") {
  const auto all = parse_stream_selection("3", "--tee");
  CHECK(all.for_local_rank(0) == 3);
  CHECK(all.for_local_rank(7) == 3);
  const auto per = parse_stream_selection("0:1,2:2", "--redirects");
  CHECK(per.for_local_rank(0) == kStdoutBit);
  CHECK(per.for_local_rank(1) == 0);
  CHECK(per.for_local_rank(2) == kStderrBit);
  CHECK(per.any());
  CHECK_FALSE(parse_stream_selection("0", "--tee").any());
}

TEST_CASE("--nproc_per_node cpu counts usable CPUs; gpu counts visible GPUs") {
  CHECK(parse_nproc_per_node("cpu") >= 1);
  CHECK(parse_nproc_per_node("auto") >= 1);
  CHECK(parse_nproc_per_node("7") == 7);
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  CHECK(count_visible_gpus() == 0);
  CHECK_THROWS_WITH(parse_nproc_per_node("gpu"), Catch::Contains("CUDA_VISIBLE_DEVICES"));
  ::unsetenv("CUDA_VISIBLE_DEVICES");
}

TEST_CASE("cpu_bind cores splits the CPUs into equal slices, hyperthreads of a core together") {
  CHECK(parse({"prog"}).cpu_bind == CpuBind::kNone);
  CHECK(parse({"--cpu-bind=cores", "prog"}).cpu_bind == CpuBind::kCores);
  CHECK_THROWS_WITH(parse({"--cpu_bind", "socket", "prog"}),
                    Catch::Contains("--cpu_bind: expected 'none' or 'cores', found 'socket'"));

  // Two packages of two cores with two hyperthreads each, numbered as Linux does
  // (siblings n and n+4).
  std::vector<CpuInfo> smt;
  for (int cpu = 0; cpu < 8; ++cpu) smt.push_back({cpu, (cpu % 4) / 2, cpu % 2});
  using Slices = std::vector<std::vector<int>>;
  CHECK(split_cpus(smt, 1) == Slices{{0, 1, 2, 3, 4, 5, 6, 7}});
  CHECK(split_cpus(smt, 2) == Slices{{0, 1, 4, 5}, {2, 3, 6, 7}});
  CHECK(split_cpus(smt, 4) == Slices{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  // 4 cores for 3 workers: one each, and the last core (3 and 7) is nobody's.
  CHECK(split_cpus(smt, 3) == Slices{{0, 4}, {1, 5}, {2, 6}});
  // More workers than cores: single CPUs, siblings side by side.
  CHECK(split_cpus(smt, 8) == Slices{{0}, {4}, {1}, {5}, {2}, {6}, {3}, {7}});
  CHECK(split_cpus(smt, 6) == Slices{{0}, {4}, {1}, {5}, {2}, {6}});
  // 8 cores of 2 hyperthreads (siblings c and c + 8) for 3 workers: two whole cores each,
  // never one core's two hyperthreads in two workers (5.33 CPUs a worker would split them).
  std::vector<CpuInfo> sixteen;
  for (int cpu = 0; cpu < 16; ++cpu) sixteen.push_back({cpu, 0, cpu % 8});
  CHECK(split_cpus(sixteen, 3) == Slices{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}});

  // A taskset-restricted launcher: only its own CPUs are shared out.
  const std::vector<CpuInfo> some{{3, 0, 3}, {5, 0, 5}, {6, 0, 6}};
  CHECK(split_cpus(some, 2) == Slices{{3}, {5}});
  CHECK_THROWS_WITH(split_cpus(some, 4),
                    Catch::Contains("expected at least one CPU per local worker, found 4 "
                                    "workers and 3 usable CPU(s) (3,5-6)"));

  CHECK(format_cpu_list({}) == "");
  CHECK(format_cpu_list({7}) == "7");
  CHECK(format_cpu_list({4, 0, 1, 2, 10, 11, 2}) == "0-2,4,10-11");

  // The machine's own CPUs: each usable one once.
  const auto here = usable_cpus();
  REQUIRE_FALSE(here.empty());
  for (size_t i = 1; i < here.size(); ++i) CHECK(here[i - 1].cpu < here[i].cpu);
}

TEST_CASE("the worker environment overrides inherited launcher variables") {
  WorkerEnvInputs in{.local_rank = 1,
                     .global_rank = 5,
                     .local_world_size = 2,
                     .world_size = 6,
                     .group_rank = 2,
                     .group_world_size = 3,
                     .role = "default",
                     .master_addr = "10.1.1.1",
                     .master_port = 4242,
                     .store_addr = "10.1.1.1",
                     .store_port = 29500,
                     .restart_count = 1,
                     .max_restarts = 3,
                     .run_id = "r",
                     .error_file = "/e.json",
                     .store_token = "tok",
                     .store_prefix = "job/r/attempt_1"};
  const auto env = build_worker_environment({"RANK=99", "PATH=/bin", "HOME=/root"}, in);
  const auto has = [&](const std::string& kv) {
    return std::find(env.begin(), env.end(), kv) != env.end();
  };
  CHECK(has("RANK=5"));
  CHECK_FALSE(has("RANK=99"));
  CHECK(has("PATH=/bin"));
  CHECK(has("LOCAL_RANK=1"));
  CHECK(has("GROUP_RANK=2"));
  CHECK(has("ROLE_RANK=5"));
  CHECK(has("MASTER_ADDR=10.1.1.1"));
  CHECK(has("MASTER_PORT=4242"));
  CHECK(has("MTRAIN_STORE_ADDR=10.1.1.1"));
  CHECK(has("MTRAIN_STORE_PORT=29500"));
  CHECK(has("TORCHELASTIC_USE_AGENT_STORE=False"));
  CHECK(has("TORCH_NCCL_ASYNC_ERROR_HANDLING=1"));
  CHECK(has("TORCHELASTIC_RESTART_COUNT=1"));
  CHECK(has("MTRAIN_STORE_PREFIX=job/r/attempt_1"));
  CHECK(std::none_of(env.begin(), env.end(),
                     [](const std::string& e) { return e.rfind("OMP_NUM_THREADS=", 0) == 0; }));
  // A user's NCCL setting is kept.
  const auto user_nccl = build_worker_environment({"NCCL_ASYNC_ERROR_HANDLING=0"}, in);
  CHECK(std::count(user_nccl.begin(), user_nccl.end(), "NCCL_ASYNC_ERROR_HANDLING=0") == 1);
  CHECK(std::none_of(user_nccl.begin(), user_nccl.end(),
                     [](const std::string& e) { return e == "NCCL_ASYNC_ERROR_HANDLING=1"; }));
  in.omp_num_threads = 1;
  const auto with_omp = build_worker_environment({}, in);
  CHECK(std::find(with_omp.begin(), with_omp.end(), "OMP_NUM_THREADS=1") != with_omp.end());
}

TEST_CASE("error files: mtrain's flat record, torchrun's nested one, and garbage") {
  mtrain::testing::TempDir dir;
  const auto path = dir.path() / "error.json";
  CHECK_FALSE(read_error_file(path).has_value());

  std::ofstream(path) << R"({"rank": 3, "host": "h", "message": "disk full", "timestamp": 1700000000.5})";
  auto rec = read_error_file(path);
  REQUIRE(rec);
  CHECK(rec->message == "disk full");
  CHECK(rec->timestamp.value() == Approx(1700000000.5));

  std::ofstream(path) << R"({"message": {"message": "ValueError: x", "extraInfo": )"
                         R"({"py_callstack": "Traceback ...", "timestamp": "1700000001"}}})";
  rec = read_error_file(path);
  REQUIRE(rec);
  CHECK(rec->message == "ValueError: x");
  CHECK(rec->traceback == "Traceback ...");
  CHECK(rec->timestamp.value() == Approx(1700000001));

  std::ofstream(path) << "{\"message\": \"trunc";
  rec = read_error_file(path);
  REQUIRE(rec);
  CHECK_THAT(rec->message, Catch::Contains("not valid JSON"));
  CHECK_FALSE(rec->timestamp.has_value());

  // A time that is no time is no time: NaN would win no comparison and keep the root
  // cause's place whatever failed first.
  for (const char* bad : {R"("nan")", R"("inf")", R"("-inf")"}) {
    std::ofstream(path) << R"({"message": "m", "timestamp": )" << bad << "}";
    rec = read_error_file(path);
    REQUIRE(rec);
    CHECK_FALSE(rec->timestamp.has_value());
  }

  // The excerpt of a broken file (its first 200 bytes) stops before a character it
  // would cut in half: here 0xc3 0xa9 straddles byte 200.
  std::string long_text = "{\"message\": \"" + std::string(199 - 13, 'x') + "\xc3\xa9 and more";
  std::ofstream(path) << long_text;
  rec = read_error_file(path);
  REQUIRE(rec);
  CHECK_THAT(rec->message, Catch::Contains("it starts with '{\"message\""));
  CHECK(rec->message.find("\xc3'") == std::string::npos);
}

TEST_CASE("the root cause is the earliest failure and the report explains it") {
  Failure late;
  late.global_rank = 0;
  late.local_rank = 0;
  late.timestamp = 200;
  late.status.code = 1;
  Failure early;
  early.global_rank = 3;
  early.local_rank = 1;
  early.node_rank = 1;
  early.host = "node-b";
  early.pid = 4321;
  early.timestamp = 100;
  early.status.signaled = true;
  early.status.signal = SIGKILL;
  CHECK(pick_root_cause({late, early}) == 1);
  CHECK(pick_root_cause({early, late}) == 0);

  FailureReport report;
  report.program = "train";
  report.root_cause = early;
  report.other_failures = {late};
  report.stopped_ranks = {1, 2};
  const std::string text = format_failure_report(report);
  CHECK_THAT(text, Catch::Contains("train FAILED (attempt 0, no restarts configured)"));
  CHECK_THAT(text, Catch::Contains("rank       : 3 (local_rank 1, node 1)"));
  CHECK_THAT(text, Catch::Contains("host       : node-b"));
  CHECK_THAT(text, Catch::Contains("pid        : 4321"));
  CHECK_THAT(text, Catch::Contains("signal 9 (SIGKILL)"));
  CHECK_THAT(text, Catch::Contains("OOM killer"));
  CHECK_THAT(text, Catch::Contains("rank 0 (local_rank 0, node 0): exit code 1"));
  CHECK_THAT(text, Catch::Contains("ranks 1, 2"));

  // The JSON round trip that carries a root cause to the other nodes.
  const Failure back = failure_from_json(failure_to_json(early));
  CHECK(back.global_rank == 3);
  CHECK(back.status.signal == SIGKILL);
  CHECK(back.host == "node-b");
  CHECK_THROWS_AS(failure_from_json(nlohmann::json{{"rank", 1}}), InvalidArgument);
}

TEST_CASE("hints for signals and shell-style exit codes") {
  CHECK_THAT(signal_hint(SIGSEGV, false), Catch::Contains("native code"));
  CHECK_THAT(signal_hint(SIGKILL, true), Catch::Contains("ignored SIGTERM"));
  CHECK_THAT(signal_hint(SIGBUS, false), Catch::Contains("/dev/shm"));
  CHECK(signal_hint(SIGWINCH, false).empty());
  Failure via_shell;
  via_shell.status.code = 137;
  CHECK_THAT(failure_hint(via_shell), Catch::Contains("SIGKILL"));
  via_shell.status.code = 1;
  CHECK(failure_hint(via_shell).empty());
  CHECK(format_utc(0.25) == "1970-01-01T00:00:00.250Z");
}

TEST_CASE("has_child_in_group finds the launcher's children by group, and nothing once they are reaped") {
  // Note [Signalling a reaped worker's group].
  const pid_t child = fork();
  if (child == 0) {
    setpgid(0, 0);
    pause();
    _exit(0);
  }
  REQUIRE(child > 0);
  setpgid(child, child);
  CHECK(mtrain::launch::has_child_in_group(child));
  CHECK_FALSE(mtrain::launch::has_child_in_group(::getpgrp()));  // no child of ours leads this one
  ::kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  CHECK_FALSE(mtrain::launch::has_child_in_group(child));
}

TEST_CASE("the root cause is chosen by causality before time (Note [Root cause])") {
  Failure noticed;  // the peer that noticed, earlier by its error file
  noticed.global_rank = 0;
  noticed.timestamp = 100;
  noticed.status.code = 1;
  noticed.error_file = "/tmp/e0";
  noticed.message = "allreduce #7 failed: Connection reset by peer";
  Failure killed;  // the rank that vanished, seen late by a delayed launcher
  killed.global_rank = 1;
  killed.timestamp = 101;
  killed.status.signaled = true;
  killed.status.signal = SIGKILL;
  CHECK(pick_root_cause({noticed, killed}) == 1);
  Failure genuine;  // an error of its own, later than the consequence
  genuine.global_rank = 2;
  genuine.timestamp = 150;
  genuine.status.code = 2;
  genuine.error_file = "/tmp/e2";
  genuine.message = "checkpoint /c is truncated";
  CHECK(pick_root_cause({noticed, genuine}) == 1);
  // Within a class, the earliest.
  Failure other = genuine;
  other.timestamp = 120;
  CHECK(pick_root_cause({genuine, other}) == 1);
  // A rank the launcher SIGKILLed after --term_timeout is not the cause.
  Failure straggler = killed;
  straggler.sigkilled_by_launcher = true;
  CHECK(pick_root_cause({straggler, genuine}) == 1);
  // A rank that wrote its error and then crashed on the way out outranks an earlier exit code...
  Failure crashed = genuine;
  crashed.global_rank = 3;
  crashed.timestamp = 200;
  crashed.status = {};
  crashed.status.signaled = true;
  crashed.status.signal = SIGSEGV;
  CHECK(pick_root_cause({other, crashed}) == 1);
  // ...unless its error says a peer vanished: then the crash followed another rank's failure.
  Failure crashed_after_peer = noticed;
  crashed_after_peer.status = crashed.status;
  CHECK(pick_root_cause({crashed_after_peer, genuine}) == 1);
}

TEST_CASE("a collective timeout's message names the ranks that never reached it") {
  CHECK(ranks_named_missing("allreduce #3 timed out after 5 s; rank 1 never reached it (its last operation: x)") ==
        std::vector<int>{1});
  CHECK(ranks_named_missing("timed out; ranks 1, 3 never reached it (last operations: a, b)") ==
        std::vector<int>{1, 3});
  CHECK(ranks_named_missing("Connection reset by peer").empty());
  FailureReport report;
  report.program = "train";
  report.root_cause.global_rank = 0;
  report.root_cause.message = "allreduce #3 timed out; rank 2 never reached it (its last operation: allreduce #2)";
  const std::string text = format_failure_report(report);
  CHECK_THAT(text, Catch::Contains("rank       : 2 (never reached the collective that timed out; reported by rank 0)"));
  CHECK_THAT(text, Catch::Contains("reported by: rank 0 (local_rank -1, node 0)"));
}

TEST_CASE("a rank found stopped inside a collective that timed out is named, not the rank that reported it") {
  CHECK(says_every_rank_arrived("allreduce #3 timed out after 5 s: every rank reached it, so a peer is stuck"));
  CHECK_FALSE(says_every_rank_arrived("allreduce #3 timed out after 5 s: rank 1 never reached it"));
  FailureReport report;
  report.program = "train";
  report.root_cause.global_rank = 0;
  report.root_cause.message = "allreduce #3 timed out after 5 s: every rank reached it, so a peer is stuck inside it";
  const std::string unnamed = format_failure_report(report);
  CHECK_THAT(unnamed, Catch::Contains("rank       : 0 (local_rank -1, node 0)"));
  CHECK_THAT(unnamed, !Catch::Contains("found stopped"));

  report.stopped_ranks = {1, 2};
  report.found_stopped_ranks = {2};
  report.root_cause.stopped_peers = {2};
  // As another node reads it from the store: the same ranks.
  report.root_cause = failure_from_json(failure_to_json(report.root_cause));
  CHECK(report.root_cause.stopped_peers == std::vector<int>{2});
  const std::string text = format_failure_report(report);
  CHECK_THAT(text, Catch::Contains("rank       : 2 (found stopped (SIGSTOP) inside the collective that timed out; "
                                   "reported by rank 0)"));
  CHECK_THAT(text, Catch::Contains("reported by: rank 0 (local_rank -1, node 0)"));
  CHECK_THAT(text, Catch::Contains("Stopped by the launcher after the root cause: ranks 1, 2\n"
                                   "  of which were found stopped (SIGSTOP) and got SIGKILL: rank 2\n"));

  // A message that names the ranks that never arrived is believed over a stopped rank.
  report.root_cause.message = "allreduce #3 timed out; rank 1 never reached it (its last operation: allreduce #2)";
  CHECK_THAT(format_failure_report(report), Catch::Contains("rank       : 1 (never reached the collective"));
}

TEST_CASE("an error that will repeat travels in the error file and the root cause, and the report says so") {
  mtrain::testing::TempDir dir;
  const std::filesystem::path path = dir.path() / "error.json";
  std::ofstream(path) << R"({"message": "--lr: expected a number", "timestamp": 1.5, "will_repeat": true})";
  const auto rec = read_error_file(path);
  REQUIRE(rec);
  CHECK(rec->will_repeat);
  Failure f;
  f.global_rank = 0;
  f.will_repeat = true;
  CHECK(failure_from_json(failure_to_json(f)).will_repeat);
  FailureReport report;
  report.program = "train";
  report.max_restarts = 2;
  report.root_cause = f;
  report.restarts_unused_because = "the root cause says it would repeat";
  CHECK_THAT(format_failure_report(report),
             Catch::Contains("FAILED (attempt 0, 2 restart(s) left, not used: the root cause says it would repeat)"));
}

// Note [Stopped workers at teardown] rests on telling a stopped worker from a running one.
TEST_CASE("a worker stopped by a signal is seen as stopped until it continues") {
  using mtrain::launch::WorkerProcess;
  using mtrain::launch::WorkerSpec;
  WorkerSpec spec;
  spec.executable = "/bin/sleep";
  spec.argv = {"sleep", "30"};
  WorkerProcess w = WorkerProcess::spawn(spec);
  const auto becomes = [&](bool stopped) {
    for (int i = 0; i < 200; ++i) {
      if (w.stopped() == stopped) return true;
      ::usleep(10000);
    }
    return false;
  };
  CHECK(becomes(false));
  w.signal_group(SIGSTOP);
  CHECK(becomes(true));
  w.signal_group(SIGCONT);
  CHECK(becomes(false));
  w.signal_group(SIGKILL);
  for (int i = 0; i < 200 && !w.try_reap(); ++i) ::usleep(10000);
  REQUIRE_FALSE(w.running());
  CHECK_FALSE(w.stopped());
}

TEST_CASE("a worker's end is counted against the teardown: its own failure, stopped, or exited early") {
  // Note [Root cause]; the teardown began at t = 100.
  const auto kind = [](ExitStatus st, double exit_time, std::optional<double> error_time = std::nullopt,
                       bool sigkilled_by_launcher = false) {
    return classify_worker_end({st, exit_time, error_time, sigkilled_by_launcher}, 100.0);
  };
  const ExitStatus exit1{false, 1, 0};
  const ExitStatus ok{false, 0, 0};
  const auto signaled = [](int sig) { return ExitStatus{true, 0, sig}; };
  CHECK(kind(exit1, 99) == WorkerEndKind::kFailedOnItsOwn);
  // Seen late, but its error record says it failed before the teardown.
  CHECK(kind(exit1, 105, 98.5) == WorkerEndKind::kFailedOnItsOwn);
  CHECK(kind(exit1, 105) == WorkerEndKind::kStoppedByTeardown);
  CHECK(kind(signaled(SIGTERM), 101) == WorkerEndKind::kStoppedByTeardown);
  CHECK(kind(signaled(SIGKILL), 104, std::nullopt, true) == WorkerEndKind::kStoppedByTeardown);
  // A signal the launcher never sends is the worker's own, however late.
  CHECK(kind(signaled(SIGSEGV), 101) == WorkerEndKind::kFailedOnItsOwn);
  CHECK(kind(signaled(SIGKILL), 104) == WorkerEndKind::kFailedOnItsOwn);
  CHECK(kind(ok, 50) == WorkerEndKind::kExitedEarly);
  CHECK(kind(ok, 101) == WorkerEndKind::kStoppedByTeardown);
  // Without a teardown there is nothing to count a failure against.
  CHECK(classify_worker_end({exit1, 99, std::nullopt, false}, 0.0) == WorkerEndKind::kUncounted);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) CHECK(launcher_sends(sig));
  for (int sig : {SIGKILL, SIGSEGV, SIGABRT, SIGPIPE}) CHECK_FALSE(launcher_sends(sig));
}
