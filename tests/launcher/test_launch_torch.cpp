// mtrain-launch as a drop-in for torchrun: unmodified PyTorch programs (Debian's
// python3-torch at /usr/bin/python3, which scripts/setup.sh --tests installs), compared with the
// same programs under torchrun. Skips as a whole when that Python cannot import torch.
#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>
#include <string>
#include <vector>

#include "tests/store/store_test_util.h"
#include "tests/launcher/launch_harness.h"
#include "tests/support/skip.h"
#include "tests/support/test_paths.h"

using namespace mtrain::testing;
namespace fs = std::filesystem;

namespace {

const std::string kPython = "/usr/bin/python3";

std::string script(const std::string& name) { return source_dir() + "/tests/launcher/torch/" + name; }

void require_torch() {
  if (std::system((kPython + " -c 'import torch.distributed' >/dev/null 2>&1").c_str()) != 0) {
    skip_test_binary("/usr/bin/python3 cannot import torch (apt-get install python3-torch)");
  }
}

// The launcher's environment for these tests: Debian's Python runs the programs.
const std::vector<std::string> kEnv = {"MTRAIN_PYTHON=" + kPython};

// Rank 0's "step N loss L" lines, whatever prefix a launcher put in front of them.
std::vector<std::string> losses(const std::string& output) {
  std::vector<std::string> lines;
  const std::regex line(R"(step \d+ loss [0-9.]+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line); it != std::sregex_iterator(); ++it) {
    lines.push_back(it->str());
  }
  return lines;
}

// The same program under PyTorch's own launcher. Debian's torchrun on Python 3.11 needs
// --redirects 1 --tee 1 to start; the [default0]: prefixes are skipped by losses().
std::vector<std::string> torchrun_losses(const TempDir& dir, int nproc, const std::vector<std::string>& program) {
  std::string command = kPython + " -m torch.distributed.run --nproc_per_node=" + std::to_string(nproc) +
                        " --redirects 1 --tee 1 --master_port " + std::to_string(unused_loopback_port());
  for (const std::string& a : program) command += " '" + a + "'";
  command += " > " + (dir.path() / "torchrun.out").string() + " 2>&1";
  command = "timeout 120 " + command;
  REQUIRE(std::system(command.c_str()) == 0);
  return losses(read_text(dir.path() / "torchrun.out"));
}

void require_success(const LaunchResult& r) {
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE_FALSE(r.timed_out);
  REQUIRE(r.exit_code == 0);
}

}  // namespace

TEST_CASE("an unmodified PyTorch DDP script trains under mtrain-launch exactly as under torchrun") {
  require_torch();
  TempDir dir;
  const auto reference = torchrun_losses(dir, 2, {script("ddp_tutorial.py")});
  REQUIRE(reference.size() == 5);
  const auto r = run_launcher({"--nproc_per_node=2", script("ddp_tutorial.py")}, dir.path(), 120, kEnv);
  require_success(r);
  CHECK(losses(r.out) == reference);
  CHECK_THAT(r.err, Catch::Contains("with the Python interpreter " + kPython));

  SECTION("after a restart, when one rank fails once") {
    const auto again = run_launcher({"--nproc_per_node=2", "--max_restarts=1", script("ddp_tutorial.py"),
                                     "--fail-once-on-rank", "1"},
                                    dir.path(), 120, kEnv);
    require_success(again);
    CHECK_THAT(again.err, Catch::Contains("restarting the gang"));
    CHECK(losses(again.out) == reference);
  }
  SECTION("as a module (-m), through runpy (--run_path), and under --standalone") {
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"--nproc_per_node=2", "-m", "ddp_tutorial"},
          std::vector<std::string>{"--nproc_per_node=2", "--run_path", script("ddp_tutorial.py")},
          std::vector<std::string>{"--standalone", "--nproc_per_node=2", script("ddp_tutorial.py")}}) {
      INFO(args[1]);
      std::vector<std::string> env = kEnv;
      env.push_back("PYTHONPATH=" + source_dir() + "/tests/launcher/torch");
      const auto run = run_launcher(args, dir.path(), 120, env);
      require_success(run);
      CHECK(losses(run.out) == reference);
    }
  }
}

TEST_CASE("two launchers as two nodes on loopback run a PyTorch script as one world of four") {
  require_torch();
  TempDir dir;
  const auto reference = torchrun_losses(dir, 4, {script("ddp_tutorial.py")});
  REQUIRE(reference.size() == 4);  // 256 samples over 4 ranks: 4 batches of 16 each
  const std::string port = std::to_string(unused_loopback_port());
  std::vector<std::string> env = kEnv;
  env.push_back("MTRAIN_STORE_TOKEN=t");
  const std::vector<std::string> common = {"--nnodes=2", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                                           "--master_port=" + port};
  auto with_rank = [&](const char* rank) {
    std::vector<std::string> args = common;
    args.push_back(std::string("--node_rank=") + rank);
    args.push_back(script("ddp_tutorial.py"));
    return args;
  };
  LauncherProcess node1(with_rank("1"), dir.path(), env, "node1");
  LauncherProcess node0(with_rank("0"), dir.path(), env, "node0");
  const LaunchResult r0 = node0.wait(120), r1 = node1.wait(120);
  require_success(r0);
  require_success(r1);
  CHECK(losses(r0.out) == reference);

  SECTION("and through the dynamic rendezvous on a loopback endpoint, without a token") {
    // The issue's own command shape: --nnodes=MIN:MAX --rdzv-endpoint=localhost:PORT.
    const std::vector<std::string> dynamic = {"--nnodes=2:2", "--nproc_per_node=2",
                                              "--rdzv-endpoint=localhost:" + std::to_string(unused_loopback_port()),
                                              "--rdzv-id=torchjob", script("ddp_tutorial.py")};
    LauncherProcess a(dynamic, dir.path(), kEnv, "dyn_a");
    LauncherProcess b(dynamic, dir.path(), kEnv, "dyn_b");
    const LaunchResult ra = a.wait(120), rb = b.wait(120);
    require_success(ra);
    require_success(rb);
    CHECK_THAT(ra.err + rb.err, Catch::Contains("MTRAIN_STORE_TOKEN is not set: the launchers' store on loopback"));
    // Whichever launcher joined first is node 0 and prints rank 0's losses.
    CHECK(losses(ra.out + rb.out) == reference);
  }
}

TEST_CASE("--no_python runs a .py program directly, by its #! line") {
  TempDir dir;
  const fs::path program = dir.path() / "hello.py";
  std::ofstream(program) << "#!/bin/sh\necho \"not python: rank $RANK\"\n";
  fs::permissions(program, fs::perms::owner_all);
  const auto r = run_launcher({"--nproc_per_node=2", "--no_python", program.string()}, dir.path(), 30);
  require_success(r);
  CHECK_THAT(r.out, Catch::Contains("not python: rank 0") && Catch::Contains("not python: rank 1"));
  CHECK_THAT(run_launcher({"--no_python", "-m", "x"}, dir.path(), 10).err,
             Catch::Contains("--no_python and --module contradict each other"));
}

TEST_CASE("an @record failure: its traceback is in the report, its error file outlives the launcher") {
  require_torch();
  TempDir dir;
  // The worker count comes from PET_NPROC_PER_NODE, as torchrun reads it.
  std::vector<std::string> env = kEnv;
  env.push_back("PET_NPROC_PER_NODE=2");
  const auto r = run_launcher({script("elastic_worker.py"), "--fail-rank", "1"}, dir.path(), 60, env);
  INFO("stderr:\n" << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 1);
  // Rank 0 may be stopped before it prints: rank 1 alone shows the world of two.
  CHECK_THAT(r.out, Catch::Contains("rank 1 of 2"));
  CHECK_THAT(r.err, Catch::Contains("rank       : 1 (local_rank 1") &&
                        Catch::Contains("message    : ValueError: rank 1 failed on purpose"));
  CHECK_THAT(r.err, Catch::Contains("traceback  : Traceback (most recent call last)") && Catch::Contains("in fail"));
  CHECK_THAT(r.err, Catch::Contains("keeping /") && Catch::Contains("for the error file the report names"));
  std::smatch found;
  const std::regex error_file(R"(error_file : (\S+))");
  REQUIRE(std::regex_search(r.err, found, error_file));
  const fs::path path = found[1].str();
  CHECK(fs::exists(path));
  CHECK_THAT(read_text(path), Catch::Contains("py_callstack") && Catch::Contains("failed on purpose"));
  fs::remove_all(path.parent_path().parent_path().parent_path());  // the launcher's run directory
}

TEST_CASE("SIGTERM to the launcher reaches the PyTorch script's own handler") {
  require_torch();
  TempDir dir;
  LauncherProcess launcher({"--nproc_per_node=2", script("elastic_worker.py"), "--wait-dir", dir.str()}, dir.path(),
                           kEnv);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!(fs::exists(dir.path() / "ready_0") && fs::exists(dir.path() / "ready_1")) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  REQUIRE(fs::exists(dir.path() / "ready_0"));
  REQUIRE(fs::exists(dir.path() / "ready_1"));
  ::kill(launcher.pid(), SIGTERM);
  const LaunchResult r = launcher.wait(60);
  INFO("stderr:\n" << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 128 + SIGTERM);
  CHECK(read_text(dir.path() / "sigterm_0") == "SIGTERM\n");
  CHECK(read_text(dir.path() / "sigterm_1") == "SIGTERM\n");
}
