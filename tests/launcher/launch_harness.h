// Running mtrain-launch from a test: spawn it with its output captured in files, wait
// with a bound, and check which processes are still alive.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/test_paths.h"

extern char** environ;

namespace mtrain::testing {

namespace fs = std::filesystem;

inline std::string launcher_path() { return bin_dir() + "/mtrain-launch"; }
#ifdef LAUNCH_TEST_WORKER
// The test worker of the including test (set per target in its CMakeLists.txt).
inline std::string worker_path() { return LAUNCH_TEST_WORKER; }
#endif

inline std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "mtrain-launch-test-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

struct LaunchResult {
  bool timed_out = false;
  bool signaled = false;
  int exit_code = -1;
  int signal = 0;
  double seconds = 0;
  std::string out;
  std::string err;
};

// One mtrain-launch process. Its environment is the test's, without OMP_NUM_THREADS
// and MTRAIN_STORE_TOKEN, plus `extra_env` ("KEY=VALUE").
class LauncherProcess {
 public:
  LauncherProcess(const std::vector<std::string>& args, const fs::path& output_dir,
                  const std::vector<std::string>& extra_env = {}, const std::string& name = "launch")
      : out_path_(output_dir / (name + ".out")), err_path_(output_dir / (name + ".err")) {
    std::vector<std::string> argv_s{launcher_path()};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<std::string> env_s;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      if (entry.rfind("OMP_NUM_THREADS=", 0) == 0 || entry.rfind("MTRAIN_STORE_TOKEN=", 0) == 0) {
        continue;
      }
      env_s.push_back(entry);
    }
    env_s.insert(env_s.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);

    // The launcher reads a file with text in it, so a test can tell whether its workers
    // read the launcher's standard input (they must not: Note [Worker process hygiene]).
    const fs::path stdin_path = output_dir / (name + ".stdin");
    std::ofstream(stdin_path) << "the launcher's input, not the workers'\n";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, stdin_path.c_str(), O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    start_ = std::chrono::steady_clock::now();
    if (posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data()) != 0) {
      throw std::runtime_error("posix_spawn of mtrain-launch failed");
    }
    posix_spawn_file_actions_destroy(&actions);
  }

  ~LauncherProcess() {
    if (!reaped_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }

  pid_t pid() const { return pid_; }

  // Waits at most `timeout_s`; a launcher still running then is SIGKILLed and the result
  // says timed_out.
  LaunchResult wait(double timeout_s) {
    LaunchResult r;
    const auto deadline = start_ + std::chrono::duration<double>(timeout_s);
    int status = 0;
    while (true) {
      const pid_t got = waitpid(pid_, &status, WNOHANG);
      if (got == pid_) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        r.timed_out = true;
        ::kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    reaped_ = true;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    r.signaled = WIFSIGNALED(status);
    r.signal = r.signaled ? WTERMSIG(status) : 0;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_text(out_path_);
    r.err = read_text(err_path_);
    return r;
  }

 private:
  fs::path out_path_;
  fs::path err_path_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::chrono::steady_clock::time_point start_;
};

inline LaunchResult run_launcher(const std::vector<std::string>& args, const fs::path& output_dir,
                                 double timeout_s = 30,
                                 const std::vector<std::string>& extra_env = {}) {
  LauncherProcess p(args, output_dir, extra_env);
  return p.wait(timeout_s);
}

// Alive = exists and is not a zombie (a zombie holds no resources; whoever inherited it
// reaps it).
inline bool process_alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  const char state = text[close + 2];
  return state != 'Z' && state != 'X';
}

// Exists at all, zombie or not: after a launcher exited normally its workers and
// their children must be reaped, not merely dead.
inline bool process_exists(pid_t pid) { return fs::exists("/proc/" + std::to_string(pid)); }

inline bool wait_until(const std::function<bool()>& pred, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

// A worker's record (launch_test_worker `record=`): KEY=VALUE lines.
using Record = std::map<std::string, std::string>;

inline Record read_record(const fs::path& p) {
  Record r;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) r[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return r;
}

// Every record of `attempt` in `dir`, by global rank.
inline std::map<int, Record> read_records(const fs::path& dir, int attempt = 0) {
  std::map<int, Record> out;
  const std::string suffix = "_attempt" + std::to_string(attempt) + ".txt";
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank", 0) != 0 || name.size() <= suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    out[std::stoi(name.substr(4))] = read_record(e.path());
  }
  return out;
}

// Pids of every worker and every child they spawned, as recorded in `dir`.
inline std::vector<pid_t> recorded_pids(const fs::path& dir) {
  std::vector<pid_t> pids;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank", 0) == 0 && e.path().extension() == ".txt") {
      pids.push_back(std::stoi(read_record(e.path()).at("pid")));
    } else if (name.rfind("child_", 0) == 0) {
      pids.push_back(std::stoi(read_text(e.path())));
    }
  }
  return pids;
}

inline size_t count_files_with_prefix(const fs::path& dir, const std::string& prefix) {
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
  }
  return n;
}

// A port nobody listens on right now (bound then released; the kernel does not hand
// it out again at once).
inline int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  ::close(s);
  return port;
}

}  // namespace mtrain::testing
