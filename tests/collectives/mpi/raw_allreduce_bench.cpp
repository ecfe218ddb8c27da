// The reference for scripts/bench-collectives.sh: float32 all-reduce (sum) called
// straight through MPI or Gloo, measured like mtrain-bench (inputs rewritten before
// each iteration, only the collective timed, result checked after it) and printed in
// its row format, so the script can put the libraries next to mtrain-bench.
//   mpirun -np 2 raw_allreduce_bench mpi <min bytes> <max bytes> <warmup> <iters> [--median]
//   RANK=r WORLD_SIZE=n RAW_GLOO_STORE_DIR=<fresh shared dir> raw_allreduce_bench gloo ...
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "collectives/bench/bench_pattern.h"

namespace {

using SumFn = void (*)(void*, const void*, const void*, size_t);

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v) {
    std::fprintf(stderr, "raw_allreduce_bench: %s is not set\n", name);
    std::exit(2);
  }
  return std::atoi(v);
}

// Same pattern as mtrain-bench's allreduce: (rank + 1) * (1..13), exact sums.
float pattern(int64_t i, int it) { return static_cast<float>((i * 7 + int64_t{it} * 3) % 13 + 1); }

int run(int rank, int world, long long min_bytes, long long max_bytes, int warmup, int iters,
        bool median, const std::function<void(std::vector<float>&)>& allreduce) {
  if (rank == 0) std::printf("# %12s %12s %12s %12s %12s  %s\n", "bytes", "count", "time_us", "algbw_GB/s", "busbw_GB/s", "check");
  int failures = 0;
  for (long long bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    std::vector<float> buffer(static_cast<size_t>(bytes / 4));
    std::vector<double> seconds;
    long long wrong = 0;
    for (int it = 0; it < warmup + iters; ++it) {
      for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = (rank + 1) * pattern(i, it);
      const auto start = std::chrono::steady_clock::now();
      allreduce(buffer);
      if (it >= warmup) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      const float sum = world * (world + 1) / 2.0f;
      for (size_t i = 0; i < buffer.size(); ++i) wrong += buffer[i] != sum * pattern(i, it);
    }
    failures += wrong != 0;
    if (rank == 0) {
      const double t = mtrain::bench::iteration_time(seconds, median);
      const double algbw = bytes / t / 1e9;
      std::printf("  %12lld %12zu %12.1f %12.3f %12.3f  %s\n", bytes, buffer.size(), t * 1e6, algbw,
                  algbw * 2.0 * (world - 1) / world, wrong ? "FAIL" : "OK");
      std::fflush(stdout);
    }
  }
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool median = argc == 7 && std::string(argv[6]) == "--median";
  if (argc != 6 && !median) {
    std::fprintf(stderr, "usage: raw_allreduce_bench mpi|gloo <min bytes> <max bytes> <warmup> <iters> [--median]\n");
    return 2;
  }
  const std::string library = argv[1];
  const long long min_bytes = std::atoll(argv[2]), max_bytes = std::atoll(argv[3]);
  const int warmup = std::atoi(argv[4]), iters = std::atoi(argv[5]);
  if (library == "mpi") {
    MPI_Init(&argc, &argv);
    int rank = 0, world = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const int rc = run(rank, world, min_bytes, max_bytes, warmup, iters, median, [](std::vector<float>& b) {
      MPI_Allreduce(MPI_IN_PLACE, b.data(), static_cast<int>(b.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    });
    MPI_Finalize();
    return rc;
  }
  if (library == "gloo") {
    const int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    attr.ai_family = AF_INET;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    const char* dir = std::getenv("RAW_GLOO_STORE_DIR");
    gloo::rendezvous::FileStore store(dir ? dir : "");
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, world);
    context->connectFullMesh(store, device);
    return run(rank, world, min_bytes, max_bytes, warmup, iters, median, [&](std::vector<float>& b) {
      gloo::AllreduceOptions opts(context);
      opts.setOutput(b.data(), b.size());
      opts.setReduceFunction(static_cast<SumFn>(&gloo::sum<float>));
      gloo::allreduce(opts);
    });
  }
  std::fprintf(stderr, "raw_allreduce_bench: expected mpi or gloo, found '%s'\n", library.c_str());
  return 2;
}
