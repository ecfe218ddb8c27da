// gpu: compute-sanitizer's memcheck over a short resnet18 run of the real mtrain-train.
// A binary of its own so that it has its own time limit (the tool slows kernels tenfold
// or more) and can skip as a whole: without a GPU, and without compute-sanitizer, which it
// looks for on PATH, then under $CUDA_HOME and /usr/local/cuda.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tensor/cuda_devices.h"
#include "tests/support/skip.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/idx_slice.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"

namespace {

namespace fs = std::filesystem;

std::string find_sanitizer() {
  std::vector<fs::path> candidates;
  if (const char* path = std::getenv("PATH")) {
    std::string list = path;
    for (size_t start = 0; start <= list.size();) {
      const size_t end = std::min(list.find(':', start), list.size());
      if (end > start) candidates.emplace_back(fs::path(list.substr(start, end - start)) / "compute-sanitizer");
      start = end + 1;
    }
  }
  for (const char* root : {static_cast<const char*>(std::getenv("CUDA_HOME")), "/usr/local/cuda"}) {
    if (root == nullptr) continue;
    candidates.emplace_back(fs::path(root) / "bin" / "compute-sanitizer");
    candidates.emplace_back(fs::path(root) / "compute-sanitizer" / "compute-sanitizer");
  }
  for (const fs::path& c : candidates) {
    std::error_code ec;
    if (fs::is_regular_file(c, ec) && access(c.c_str(), X_OK) == 0) return c.string();
  }
  return {};
}

}  // namespace

TEST_CASE("compute-sanitizer memcheck finds no error in a short GPU run", "[gpu]") {
  if (mtrain::cuda_info().device_count == 0) mtrain::testing::skip_test_binary(mtrain::cuda_summary().c_str());
  const std::string sanitizer = find_sanitizer();
  if (sanitizer.empty()) {
    mtrain::testing::skip_test_binary("compute-sanitizer is not on PATH, under $CUDA_HOME or /usr/local/cuda");
  }
  mtrain::testing::TempDir dir;
  const std::string slice = dir.file("slice");
  fs::create_directory(slice);
  mtrain::testing::write_idx_slice(mtrain::testing::kMiniSet, slice, 16);
  // resnet18 covers convolution (with --cudnn-benchmark, cuDNN's trial runs and their
  // workspaces), batch norm, max and global average pooling, residual adds, linear, the
  // loss, SGD and the evaluation. memcheck sees the caching allocator's blocks, not the
  // tensors carved out of them, so it catches accesses outside any allocation and
  // misaligned accesses, not an overrun into a neighbouring
  // tensor of the same block.
  // API errors are not reported: NCCL's initialisation asks for the attributes of each of
  // its kernels, some of which have no image for the GPU at hand, and clears the error
  // (NCCL 2.28.9 on an H200 reported 8 such calls); mtrain checks every CUDA call it
  // makes itself and stops at the first that fails.
  const std::vector<std::string> args = {"--tool", "memcheck", "--report-api-errors", "no",
                                         "--error-exitcode", "99", "--print-limit", "20",
                                         mtrain::testing::kTrainer, "--device", "cuda", "--model", "resnet18",
                                         "--data-dir", slice, "--batch-size", "8", "--max-steps", "2",
                                         "--cudnn-benchmark", "--threads", "1"};
  const auto r = mtrain::testing::run_process(sanitizer, args);
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out + r.err, Catch::Contains("ERROR SUMMARY: 0 errors"));
}
