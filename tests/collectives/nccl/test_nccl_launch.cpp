// gpu + multiproc: nccl across processes started by mtrain-launch: two ranks on one GPU
// stop with a clear error before NCCL starts, and mtrain-bench --backend nccl checks its
// results. Skips the whole binary without a GPU.
#include <catch2/catch.hpp>

#include <filesystem>
#include <regex>
#include <string>

#include "tensor/cuda_devices.h"
#include "tests/launcher/launch_harness.h"
#include "tests/support/skip.h"

using namespace mtrain::testing;

namespace {
// The worker sits beside this binary (both in the build's tests/ folder, and together in
// the GPU kit), so the path holds wherever the two are unpacked.
std::string worker() {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "nccl_test_worker").string();
}

void require_gpu() {
  if (mtrain::cuda_info().device_count == 0) skip_test_binary(mtrain::cuda_summary().c_str());
}
}  // namespace

TEST_CASE("nccl: two ranks on one GPU fail before NCCL, naming both ranks and the device") {
  require_gpu();
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node=2", worker(), "same-device"}, dir.path(), 60);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.err, Catch::Contains("ranks 0 and 1 both use the GPU at PCI bus"));
  CHECK_THAT(r.err, Catch::Contains("--backend gloo"));
}

TEST_CASE("nccl: one rank per GPU all-reduces across processes") {
  require_gpu();
  const int gpus = mtrain::cuda_info().device_count;
  if (gpus < 2) WARN("one GPU: running a single rank through the launcher");
  const int nproc = gpus >= 2 ? 2 : 1;
  TempDir dir;
  const auto r = run_launcher({"--nproc_per_node=" + std::to_string(nproc), worker(),
                               "own-device"},
                              dir.path(), 120);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 0);
  for (int rank = 0; rank < nproc; ++rank) {
    CHECK_THAT(r.out, Catch::Contains("rank " + std::to_string(rank) + ": OK"));
  }
}

// With one rank, allreduce and broadcast leave their buffer as it was: their rows must
// say the check saw nothing (Note [One rank in place] in collectives/bench/main.cpp);
// allgather and reduce_scatter write a separate output, so theirs are real checks.
TEST_CASE("mtrain-bench --backend nccl: every row checked OK on device buffers") {
  require_gpu();
  for (const char* op : {"allreduce", "allgather", "broadcast", "reduce_scatter"}) {
    DYNAMIC_SECTION(op) {
      const bool blind = std::string(op) == "allreduce" || std::string(op) == "broadcast";
      TempDir dir;
      const auto r = run_launcher({"--nproc_per_node=1", "bench", "--backend", "nccl", "--op", op,
                                   "-b", "8", "-e", "16M", "-f", "8", "-w", "2", "-n", "4"},
                                  dir.path(), 120);
      INFO(r.out << r.err);
      REQUIRE_FALSE(r.timed_out);
      CHECK(r.exit_code == 0);
      CHECK_THAT(r.out, Catch::Contains("backend=nccl"));
      const std::regex ok_row(blind ? R"(\n +\d+ +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +n/a\(1-rank-in-place\))"
                                    : R"(\n +\d+ +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +OK)");
      const auto rows = std::distance(std::sregex_iterator(r.out.begin(), r.out.end(), ok_row),
                                      std::sregex_iterator());
      CHECK(rows == 8);  // 8 B .. 16 MiB by 8x
      CHECK(r.out.find("FAIL") == std::string::npos);
    }
  }
}
