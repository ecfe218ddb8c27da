// A scriptable worker for the launcher tests. Each argument is one step, run in order:
//
//   record=DIR        write DIR/rank<R>_attempt<A>.txt: "pid=<pid>" and the launcher's
//                     environment variables (KEY=VALUE lines)
//   spawn-child=DIR   fork a child that stays in this process group, writes its pid to
//                     DIR/child_rank<R>_attempt<A>.pid and sleeps for a minute
//   print-env         print RANK=.. LOCAL_RANK=.. ... on stdout, one per line
//   say=TEXT          print TEXT on stdout;  say-err=TEXT  on stderr
//   sleep=SECONDS     sleep (fractions allowed)
//   ignore-term       ignore SIGTERM from now on
//   wait-usr1=DIR     wait (up to 20 s) for SIGUSR1, then write DIR/usr1_rank<R> and go on
//   error=MESSAGE     write MTRAIN_ERROR_FILE: {"rank","host","message","timestamp"}
//   fail-attempts=A,B write an error file and exit 1 if MTRAIN_RESTART_COUNT is listed
//   barrier           join a store barrier of WORLD_SIZE ranks through the launchers'
//                     store: MTRAIN_STORE_ADDR, MTRAIN_STORE_PORT, MTRAIN_STORE_TOKEN
//                     and MTRAIN_STORE_PREFIX
//   stamp=DIR         write DIR/stamp_rank<R>: nanoseconds since the epoch, now
//                     (scripts/bench-launch.sh times the barrier with it)
//   exit=CODE         exit now with CODE
//   signal=N          kill itself with signal N (SIGTERM ignored or not)
// A step prefixed "rankN:" runs only on global rank N (e.g. "rank1:signal=9").
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "store/store.h"

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

int env_int(const char* name) { return std::atoi(env_or(name, "0").c_str()); }

constexpr const char* kReportedVars[] = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "MTRAIN_STORE_ADDR", "MTRAIN_STORE_PORT", "TORCHELASTIC_USE_AGENT_STORE",
    "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "MTRAIN_RESTART_COUNT", "MTRAIN_MAX_RESTARTS", "MTRAIN_RUN_ID", "MTRAIN_ERROR_FILE",
    "MTRAIN_STORE_TOKEN", "MTRAIN_STORE_PREFIX", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS"};

std::string tag() {
  return "rank" + env_or("RANK", "?") + "_attempt" + env_or("MTRAIN_RESTART_COUNT", "?");
}

void write_error_file(const std::string& message) {
  const std::string path = env_or("MTRAIN_ERROR_FILE", "");
  if (path.empty()) return;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::ofstream out(path);
  out << "{\"rank\": " << env_int("RANK") << ", \"host\": \"" << host << "\", \"message\": \""
      << message << "\", \"timestamp\": " << std::to_string(now) << "}\n";
}

void run_step(const std::string& step) {
  const size_t eq = step.find('=');
  const std::string name = step.substr(0, eq);
  const std::string value = eq == std::string::npos ? "" : step.substr(eq + 1);

  if (name == "record") {
    // Written aside and renamed, so a reader never sees half a record.
    const std::string path = value + "/" + tag() + ".txt";
    {
      std::ofstream out(path + ".tmp");
      out << "pid=" << getpid() << "\n";
      for (const char* var : kReportedVars) {
        if (const char* v = std::getenv(var)) out << var << "=" << v << "\n";
      }
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
  } else if (name == "spawn-child") {
    const std::string path = value + "/child_" + tag() + ".pid";
    const pid_t pid = fork();
    if (pid == 0) {
      // Written aside and renamed, like the record: a teardown may kill the child
      // between creating the file and writing it, and the test reads every such file.
      const std::string aside = value + "/pending_child_" + tag();
      { std::ofstream(aside) << getpid() << "\n"; }
      std::rename(aside.c_str(), path.c_str());
      for (int i = 0; i < 600; ++i) usleep(100'000);
      _exit(0);
    }
    // The test reads the file right after the worker's own record; wait until it exists.
    for (int i = 0; i < 200 && access(path.c_str(), F_OK) != 0; ++i) usleep(5'000);
  } else if (name == "print-env") {
    for (const char* var : kReportedVars) {
      if (const char* v = std::getenv(var)) std::printf("%s=%s\n", var, v);
    }
    std::fflush(stdout);
  } else if (name == "say") {
    std::printf("%s\n", value.c_str());
    std::fflush(stdout);
  } else if (name == "say-err") {
    std::fprintf(stderr, "%s\n", value.c_str());
  } else if (name == "sleep") {
    std::this_thread::sleep_for(std::chrono::duration<double>(std::stod(value)));
  } else if (name == "ignore-term") {
    signal(SIGTERM, SIG_IGN);
  } else if (name == "wait-usr1") {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigprocmask(SIG_BLOCK, &set, nullptr);
    // Tell the test the signal can be sent now.
    std::ofstream(value + "/ready_" + tag()) << "ready\n";
    timespec limit{20, 0};
    if (sigtimedwait(&set, nullptr, &limit) == SIGUSR1) {
      std::ofstream(value + "/usr1_rank" + env_or("RANK", "?")) << "got SIGUSR1\n";
    }
  } else if (name == "read-stdin") {
    // How many bytes standard input gave before end-of-file.
    size_t total = 0;
    char buf[256];
    for (ssize_t n; (n = read(STDIN_FILENO, buf, sizeof buf)) > 0;) total += static_cast<size_t>(n);
    std::ofstream(value + "/stdin_" + tag()) << total << "\n";
  } else if (name == "error") {
    write_error_file(value);
  } else if (name == "fail-attempts") {
    const std::string attempt = env_or("MTRAIN_RESTART_COUNT", "");
    size_t start = 0;
    while (start <= value.size()) {
      const size_t comma = std::min(value.find(',', start), value.size());
      if (value.substr(start, comma - start) == attempt) {
        write_error_file("failing on purpose on attempt " + attempt);
        std::exit(1);
      }
      start = comma + 1;
    }
  } else if (name == "barrier") {
    mtrain::TcpStore store(env_or("MTRAIN_STORE_ADDR", ""),
                           static_cast<uint16_t>(env_int("MTRAIN_STORE_PORT")),
                           env_or("MTRAIN_STORE_TOKEN", ""), std::chrono::seconds(30),
                           std::chrono::seconds(30));
    mtrain::PrefixStore scoped(env_or("MTRAIN_STORE_PREFIX", ""), store);
    scoped.barrier("test_worker", env_int("WORLD_SIZE"), std::chrono::seconds(30));
  } else if (name == "stamp") {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
    std::ofstream(value + "/stamp_rank" + env_or("RANK", "?")) << ns << "\n";
  } else if (name == "exit") {
    std::fflush(stdout);
    std::exit(std::atoi(value.c_str()));
  } else if (name == "signal") {
    const int sig = std::atoi(value.c_str());
    signal(sig, SIG_DFL);
    std::fflush(stdout);
    raise(sig);
  } else {
    std::fprintf(stderr, "launch_test_worker: unknown step '%s'\n", step.c_str());
    std::exit(90);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    for (int i = 1; i < argc; ++i) {
      std::string step = argv[i];
      if (step.rfind("rank", 0) == 0 && step.find(':') != std::string::npos &&
          step.find(':') < step.find('=')) {
        const std::string only = step.substr(4, step.find(':') - 4);
        step = step.substr(step.find(':') + 1);
        if (only != env_or("RANK", "")) continue;
      }
      run_step(step);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launch_test_worker: %s\n", e.what());
    write_error_file(e.what());
    return 91;
  }
  return 0;
}
