// mtrain-train started by Open MPI's mpirun instead of mtrain-launch (docs/mpirun.md):
// the ranks come from OMPI_COMM_WORLD_*, the MPI backend needs no store, and the Gloo
// backend gets its store from rank 0 through an MPI broadcast (trainer/setup/worker_store.h).
// Each run is compared with the same training started by mtrain-launch, through the
// weights both save with --save-final, element by element.
//
// Note [mpirun equivalence tolerance]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// mpirun and mtrain-launch start the same binary with the same flags, so every rank
// reads the same shard, starts from rank 0's weights and computes the same local
// gradient. Only the all-reduce can differ, in the order it adds the ranks' gradients:
//   - Gloo under mpirun runs the algorithm it runs under the launcher: the weights must
//     be bit-identical, at any world size.
//   - Two ranks over MPI: a sum of two floats does not depend on the order of its
//     operands, and the average divides by 2 exactly, so Open MPI's all-reduce and
//     Gloo's give the same bits: bit-identical again.
//   - Three ranks over MPI: Open MPI's tuned all-reduce associates the three gradients
//     in another order than Gloo's ring, and float addition is not associative, so some
//     elements round differently (measured after 10 mlp steps at lr 0.1: ~14% of the
//     elements differ, by at most 3e-8). The test allows kMpiThreeRankTolerance = 1e-6,
//     30x what was measured, and requires a run that must not match (two ranks, so a
//     different global batch) to differ by more than 10x that, so the check can fail.
#include <catch2/catch.hpp>

#include <chrono>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "tests/store/store_test_util.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "tests/trainer/weights_compare.h"
#include "trainer/checkpoint/safetensors.h"

using Catch::Matchers::Contains;
using mtrain::testing::ProcessResult;
using mtrain::testing::TempDir;
using mtrain::testing::kLauncher;
using mtrain::testing::kTrainer;
using mtrain::testing::kMiniSet;
using mtrain::testing::WeightDifference;
using mtrain::testing::compare_weights;
using mtrain::testing::concat;

namespace {

const std::string kMpirun = MTRAIN_MPIEXEC;
const std::string kTrainScript = MTRAIN_SOURCE_DIR "/scripts/mpirun/train.sh";
const std::string kSampleHostfile = MTRAIN_SOURCE_DIR "/scripts/mpirun/hostfile.example";
constexpr double kMpiThreeRankTolerance = 1e-6;  // Note [mpirun equivalence tolerance]

// The training every run does, whoever starts it. --timeout makes a collective that
// never completes fail within a minute instead of the default half hour;
// --check-replicas makes every run also prove its replicas stayed bitwise identical.
std::vector<std::string> training_flags(const std::string& backend, const std::string& save_final) {
  return {"--model", "mlp", "--max-steps", "10", "--batch-size", "16", "--lr", "0.1", "--no-eval",
          "--threads", "1", "--data-dir", kMiniSet, "--timeout", "60", "--check-replicas", "5",
          "--backend", backend, "--save-final", save_final};
}

// Variables that win over Open MPI's (RANK, WORLD_SIZE, ...) or move the Gloo store
// (MASTER_ADDR) if this test itself runs under a launcher. Locally started ranks inherit
// mpirun's environment, so they are removed to give the ranks what a plain shell gives.
void forget_launcher_environment() {
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                           "MASTER_PORT", "MTRAIN_STORE_ADDR", "MTRAIN_STORE_PORT", "MTRAIN_STORE_TOKEN", "MTRAIN_STORE_PREFIX",
                           "MTRAIN_RUN_ID"}) {
    ::unsetenv(name);
  }
}

// `program args...` as `np` ranks of mpirun. --allow-run-as-root: CI containers run as
// root, which mpirun refuses by default; the flag changes nothing for other users.
// More ranks than cores need --oversubscribe (Open MPI gives one slot per core), and
// mpirun's own --timeout ends a hung job before CTest's does, with a report.
ProcessResult mpirun(int np, const std::vector<std::string>& mpirun_flags, const std::string& program,
                     const std::vector<std::string>& args) {
  forget_launcher_environment();
  std::vector<std::string> argv = {"--allow-run-as-root", "--timeout", "120", "-np", std::to_string(np)};
  if (static_cast<unsigned>(np) > std::thread::hardware_concurrency()) argv.push_back("--oversubscribe");
  argv.insert(argv.end(), mpirun_flags.begin(), mpirun_flags.end());
  argv.push_back(program);
  argv.insert(argv.end(), args.begin(), args.end());
  return mtrain::testing::run_process(kMpirun, argv);
}

ProcessResult launch(int nproc, const std::vector<std::string>& train_args) {
  forget_launcher_environment();
  std::vector<std::string> argv = {fmt::format("--nproc_per_node={}", nproc), "train"};
  argv.insert(argv.end(), train_args.begin(), train_args.end());
  return mtrain::testing::run_process(kLauncher, argv);
}

void require_success(const ProcessResult& r) {
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
}

// The weights `nproc` workers of mtrain-launch train (over Gloo, the launcher's
// backend on CPU): the reference for every mpirun run of that size. Trained once per
// test process and shared by the test cases.
std::string launcher_weights(int nproc) {
  static TempDir dir;
  static std::map<int, std::string> trained;
  if (auto it = trained.find(nproc); it != trained.end()) return it->second;
  const std::string path = dir.file(fmt::format("launch{}.safetensors", nproc));
  require_success(launch(nproc, training_flags("gloo", path)));
  return trained[nproc] = path;
}

std::string log_of(const ProcessResult& r) { return r.out + r.err; }

std::string world_line(int np) {
  return fmt::format("world: {} ranks from Open MPI variables, this is rank 0", np);
}

}  // namespace

TEST_CASE("mpirun --backend mpi trains the weights mtrain-launch trains: 2 ranks bit for bit, 3 within rounding",
          "[mpi][multiproc]") {
  TempDir dir;
  const auto two = dir.file("mpi2.safetensors");
  const auto three = dir.file("mpi3.safetensors");
  const auto r2 = mpirun(2, {}, kTrainer, training_flags("mpi", two));
  require_success(r2);
  CHECK_THAT(log_of(r2), Contains(world_line(2)) && Contains("process group: mpi backend, 2 ranks"));
  const auto r3 = mpirun(3, {}, kTrainer, training_flags("mpi", three));
  require_success(r3);
  CHECK_THAT(log_of(r3), Contains(world_line(3)) && Contains("process group: mpi backend, 3 ranks"));

  const WeightDifference same2 = compare_weights(two, launcher_weights(2));
  const WeightDifference same3 = compare_weights(three, launcher_weights(3));
  const WeightDifference other = compare_weights(three, launcher_weights(2));
  INFO("2 ranks: " << same2.describe() << "\n3 ranks: " << same3.describe()
                   << "\n3 ranks against 2: " << other.describe());
  CHECK(same2.differing == 0);
  CHECK(same3.max_abs <= kMpiThreeRankTolerance);
  CHECK(other.max_abs > 10 * kMpiThreeRankTolerance);
}

TEST_CASE("mpirun --backend mpi with --balance: a split by hand trains what mtrain-launch trains, auto agrees on "
          "every split",
          "[mpi][multiproc]") {
  // static:20,12 of a global batch of 32 reads the images mtrain-launch's 2 x 16 reads at every
  // step, in other per-rank sums: equal within Note [Equivalence tolerance] of
  // tests/trainer/ddp/test_distributed_train.cpp (1e-4), not bit for bit.
  TempDir dir;
  const auto balanced = dir.file("balanced.safetensors");
  std::vector<std::string> flags = training_flags("mpi", balanced);
  for (size_t k = 0; k < flags.size(); ++k) {
    if (flags[k] == "--batch-size") flags[k] = "--global-batch-size", flags[k + 1] = "32";
  }
  const auto fixed = mpirun(2, {}, kTrainer, concat(flags, {"--balance", "static:20,12"}));
  require_success(fixed);
  const WeightDifference same = compare_weights(balanced, launcher_weights(2));
  INFO("static:20,12 over MPI against 2 x 16 over Gloo: " << same.describe());
  CHECK(same.max_abs <= 1e-4);
  // Every step checks that the ranks' batches held the global batch together (BatchResplitter).
  for (size_t k = 0; k < flags.size(); ++k) {
    if (flags[k] == "--max-steps") flags[k + 1] = "30";
  }
  const auto automatic = mpirun(2, {}, kTrainer, concat(flags, {"--balance", "auto", "--log-level", "info"}));
  require_success(automatic);
  CHECK_THAT(log_of(automatic), Contains("--balance auto: shares 16,16") && Contains("measured steps"));
}

TEST_CASE("mpirun --backend gloo without MASTER_ADDR: rank 0's store is announced over MPI, weights bit for bit",
          "[mpi][multiproc]") {
  const int np = GENERATE(2, 3);
  TempDir dir;
  const auto weights = dir.file("gloo.safetensors");
  const auto r = mpirun(np, {}, kTrainer, training_flags("gloo", weights));
  require_success(r);
  CHECK_THAT(log_of(r), Contains(world_line(np)) && Contains("announced over MPI") &&
                            Contains(fmt::format("process group: gloo backend, {} ranks", np)));
  const WeightDifference d = compare_weights(weights, launcher_weights(np));
  INFO(np << " ranks: " << d.describe());
  CHECK(d.differing == 0);
}

// Note [Workers without a shared secret] in trainer/setup/worker_store.cpp: ranks that MPI
// started share a secret for the store even when MASTER_ADDR names its address.
TEST_CASE("mpirun with MASTER_ADDR and no MTRAIN_STORE_TOKEN: rank 0 draws the store's secret and shares it over MPI",
          "[mpi][multiproc]") {
  TempDir dir;
  const auto weights = dir.file("secret.safetensors");
  const std::string port = std::to_string(mtrain::testing::unused_loopback_port());
  const auto r = mpirun(2, {"-x", "MASTER_ADDR=127.0.0.1", "-x", "MASTER_PORT=" + port}, kTrainer,
                        training_flags("gloo", weights));
  require_success(r);
  CHECK_THAT(log_of(r), Contains("its secret was drawn by rank 0 and shared over MPI") &&
                            Contains("hosted by rank 0 at 127.0.0.1:" + port));
  CHECK_THAT(log_of(r), !Contains("MTRAIN_STORE_TOKEN is not set"));
  CHECK(compare_weights(weights, launcher_weights(2)).differing == 0);
}

TEST_CASE("mpirun inside a SLURM allocation: Open MPI's ranks win over SLURM_PROCID=0 on every rank",
          "[mpi][multiproc]") {
  // What each rank sees when mpirun runs inside salloc/sbatch: the batch step's
  // SLURM_PROCID=0 and SLURM_NTASKS=1, plus a node list whose first host does not
  // exist, so a store placed by the SLURM rules could not even start.
  const std::string backend = GENERATE(std::string("mpi"), std::string("gloo"));
  TempDir dir;
  const std::vector<std::string> allocation = {
      "-x", "SLURM_PROCID=0", "-x", "SLURM_NTASKS=1", "-x", "SLURM_LOCALID=0", "-x", "SLURM_NODEID=0",
      "-x", "SLURM_NTASKS_PER_NODE=1", "-x", "SLURM_JOB_ID=4242", "-x", "SLURM_JOB_NODELIST=no-such-node[01-04]"};
  // Records what each rank saw, so the test knows the allocation reached every rank.
  const auto wrapper = dir.file("worker.sh");
  {
    std::ofstream out(wrapper);
    out << "#!/bin/sh\necho \"$SLURM_PROCID $SLURM_NTASKS\" > " << dir.path().string()
        << "/seen.$OMPI_COMM_WORLD_RANK\nexec " << kTrainer << " \"$@\"\n";
  }
  std::filesystem::permissions(wrapper, std::filesystem::perms::owner_all);
  const auto weights = dir.file("slurm.safetensors");
  const auto r = mpirun(2, allocation, wrapper, training_flags(backend, weights));
  require_success(r);
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank " << rank);
    CHECK(mtrain::testing::slurp(dir.file(fmt::format("seen.{}", rank))) == "0 1\n");
  }
  CHECK_THAT(log_of(r), Contains(world_line(2)) && Contains("process group: " + backend + " backend, 2 ranks"));
  // Had each rank believed SLURM, it would have trained alone on batch 16.
  const WeightDifference d = compare_weights(weights, launcher_weights(2));
  INFO(backend << ": " << d.describe());
  CHECK(d.differing == 0);
}

TEST_CASE("a stale WORLD_SIZE beside mpirun's variables is named, not used", "[mpi][multiproc]") {
  // A shell left over from a torchrun session: launcher variables win over Open MPI's,
  // so one that contradicts mpirun must stop the run rather than train a wrong world.
  TempDir dir;
  const auto r = mpirun(2, {"-x", "WORLD_SIZE=3", "-x", "RANK=0"}, kTrainer,
                        training_flags("mpi", dir.file("never.safetensors")));
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.err, Contains("WORLD_SIZE=3 contradicts OMPI_COMM_WORLD_SIZE=2 set by mpirun"));
  CHECK_FALSE(std::filesystem::exists(dir.file("never.safetensors")));
}

TEST_CASE("scripts/mpirun/train.sh with the sample hostfile trains what mtrain-launch trains", "[mpi][multiproc]") {
  TempDir dir;
  const auto weights = dir.file("script.safetensors");
  forget_launcher_environment();
  std::vector<std::string> argv = {"--bin", kTrainer, "--np", "2", "--threads", "1", "--hostfile", kSampleHostfile,
                                   "--"};
  for (const auto& a : training_flags("auto", weights)) argv.push_back(a);
  const auto r = mtrain::testing::run_process(kTrainScript, argv);
  require_success(r);
  // The script prints the command it runs, then mtrain-train's rank 0 logs.
  CHECK_THAT(r.out + r.err, Contains("--hostfile " + kSampleHostfile) && Contains(world_line(2)) &&
                                Contains("process group: mpi backend, 2 ranks"));
  const WeightDifference d = compare_weights(weights, launcher_weights(2));
  INFO(d.describe());
  CHECK(d.differing == 0);
}

TEST_CASE("scripts/mpirun/train.sh names a bad option and what it expected, before starting mpirun",
          "[mpi][multiproc]") {
  struct BadInput {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<BadInput> cases = {
      {{"--np", "two"}, "--np expects a positive integer, got 'two'"},
      {{"--per-node", "0"}, "--per-node expects a positive integer, got '0'"},
      {{"--bind-to", "hwthread"}, "--bind-to expects core, socket or none, got 'hwthread'"},
      {{"--hostfile", "/nonexistent/hosts"}, "--hostfile /nonexistent/hosts: no such readable file"},
      {{"--model", "mlp"}, "unknown option '--model' (mtrain-train's own flags go after --"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {"--bin", kTrainer};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const auto r = mtrain::testing::run_process(kTrainScript, argv);
    INFO("args: " << fmt::format("{}", fmt::join(c.args, " ")) << "\nstdout:\n" << r.out << "\nstderr:\n" << r.err);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Contains(c.message));
    CHECK_THAT(r.out, !Contains("+ mpirun"));
  }
}

TEST_CASE("a rank that fails after MPI started ends the mpirun job at once, not after --timeout",
          "[mpi][multiproc]") {
  // Note [A failing rank under mpirun]: rank 1's --init-from file does not exist, which it
  // finds after the group exists (a missing data directory is found before MPI starts, in
  // the run's plan); rank 0 is already waiting for rank 1's weights in the broadcast.
  // Finalising would wait for rank 0, and rank 0 would wait the 60 s --timeout.
  TempDir dir;
  std::vector<std::string> args = training_flags("mpi", dir.file("never.safetensors"));
  args.insert(args.end(), {"--init-from", launcher_weights(1), ":", "-np", "1", kTrainer});
  std::vector<std::string> broken = training_flags("mpi", dir.file("never.safetensors"));
  broken.insert(broken.end(), {"--init-from", dir.file("no-such-file.safetensors")});
  args.insert(args.end(), broken.begin(), broken.end());
  const auto start = std::chrono::steady_clock::now();
  const auto r = mpirun(1, {}, kTrainer, args);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.err, Contains("no-such-file.safetensors"));
  CHECK_THAT(r.err, Contains("mtrain-train: ending the MPI job"));
  CHECK(seconds < 40.0);  // the 60 s --timeout never comes into it
}
