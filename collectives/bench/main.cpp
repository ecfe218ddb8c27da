// mtrain-bench: a collective benchmark in the spirit of nccl-tests. Every rank runs the
// same sizes; rank 0 prints one row per size. Each iteration rewrites the inputs, times
// only the collective (issue to completion), then checks the result (Note [Bench
// pattern]); the row's check column sums the mismatches of every rank and iteration.
// With --backend nccl the buffers live on the rank's GPU (cuda:LOCAL_RANK): the pattern
// is written on the host and copied in before the timed collective, and the result is
// copied out after it, so the time column covers the collective alone, as on CPUs.
#include <cxxopts.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/bench/bench_pattern.h"
#include "collectives/bootstrap.h"
#include "collectives/process_group.h"
#include "store/store.h"
#include "core/env.h"
#include "core/error.h"
#include "core/main_guard.h"
#ifdef MTRAIN_HAVE_MPI
#include "collectives/mpi/mpi_process_group.h"
#endif
#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/stream.h"
#endif

namespace mtrain::bench {
namespace {

struct BenchOptions {
  BenchOp op = BenchOp::AllReduce;
  std::string backend = "auto";
  int64_t min_bytes = 8;
  int64_t max_bytes = 64 << 20;
  int64_t step_factor = 2;
  int64_t warmup = 5;
  int64_t iters = 20;
  int64_t timeout_s = 300;
  bool median = false;  // time column: median iteration instead of the mean
};

std::optional<BenchOptions> parse_options(int argc, char** argv) {
  cxxopts::Options cli("mtrain-bench",
                       "Collective benchmark: rank 0 prints bytes, count, time, algbw, busbw and a "
                       "correctness check per size.\nRanks come from mtrain-launch (RANK, WORLD_SIZE, "
                       "MASTER_ADDR, MASTER_PORT) or from mpirun.");
  cli.add_options()
      ("op", "allreduce | allgather | broadcast | reduce_scatter", cxxopts::value<std::string>()->default_value("allreduce"))
      ("backend", "gloo | mpi | nccl | auto (mpi under mpirun, else gloo)", cxxopts::value<std::string>()->default_value("auto"))
      ("b,min-bytes", "smallest size (K/M/G suffixes)", cxxopts::value<std::string>()->default_value("8"))
      ("e,max-bytes", "largest size (K/M/G suffixes)", cxxopts::value<std::string>()->default_value("64M"))
      ("f,step-factor", "size multiplier between rows", cxxopts::value<std::string>()->default_value("2"))
      ("w,warmup", "untimed iterations per size", cxxopts::value<std::string>()->default_value("5"))
      ("n,iters", "timed iterations per size", cxxopts::value<std::string>()->default_value("20"))
      ("timeout", "seconds one collective may take", cxxopts::value<std::string>()->default_value("300"))
      ("median", "report the median iteration time instead of the mean (nccl-tests' "
                 "definition); steadier on a shared machine, where a few iterations that "
                 "lose the CPU decide the mean")
      ("h,help", "print this help");
  cxxopts::ParseResult parsed;
  try {
    parsed = cli.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    throw InvalidArgument(fmt::format("{} (see mtrain-bench --help)", e.what()));
  }
  if (parsed.count("help")) {
    std::printf("%s\n", cli.help().c_str());
    return std::nullopt;
  }
  if (!parsed.unmatched().empty()) {
    throw InvalidArgument(fmt::format("unexpected argument '{}' (see mtrain-bench --help)",
                                      parsed.unmatched().front()));
  }
  BenchOptions o;
  o.op = parse_bench_op(parsed["op"].as<std::string>());
  o.backend = parsed["backend"].as<std::string>();
  if (o.backend != "auto") {
    bool known = false;
    for (const BackendInfo& b : known_backends()) known = known || b.name == o.backend;
    if (!known) {
      std::vector<std::string> names;
      for (const BackendInfo& b : known_backends()) names.push_back(b.name);
      throw InvalidArgument(fmt::format("--backend: expected {} or auto, found '{}'", fmt::join(names, ", "),
                                        o.backend));
    }
  }
  o.min_bytes = parse_byte_size(parsed["min-bytes"].as<std::string>(), "--min-bytes");
  o.max_bytes = parse_byte_size(parsed["max-bytes"].as<std::string>(), "--max-bytes");
  if (o.min_bytes < 1) {
    throw InvalidArgument("--min-bytes: expected at least 1 byte (sizes grow by multiplying), found 0");
  }
  if (o.min_bytes > o.max_bytes) {
    throw InvalidArgument(fmt::format("--min-bytes ({}) must not exceed --max-bytes ({})",
                                      o.min_bytes, o.max_bytes));
  }
  o.step_factor = env::parse_int(parsed["step-factor"].as<std::string>(), "--step-factor", 2, 1024);
  o.warmup = env::parse_int(parsed["warmup"].as<std::string>(), "--warmup", 0, 1'000'000);
  o.iters = env::parse_int(parsed["iters"].as<std::string>(), "--iters", 1, 1'000'000);
  o.timeout_s = env::parse_int(parsed["timeout"].as<std::string>(), "--timeout", 1, 86'400);
  o.median = parsed.count("median") > 0;
  return o;
}

std::string require_env(const char* name, const std::string& backend) {
  auto value = env::get(name);
  if (!value) {
    throw InvalidArgument(fmt::format(
        "{} is not set; --backend {} expects to be started by mtrain-launch (e.g. "
        "mtrain-launch --nproc_per_node=2 bench --backend gloo)",
        name, backend));
  }
  return *value;
}

// A backend of GPU tensors (nccl): the GPU of this local rank, as the trainer binds it;
// the CPU otherwise.
Device bench_device(const std::string& backend) {
  if (!backend_info(backend).device_tensors_only) return Device::cpu();
  return Device::cuda(static_cast<int>(env::get_int("LOCAL_RANK", 0, INT32_MAX).value_or(0)));
}

std::unique_ptr<ProcessGroup> create_group(const std::string& backend, Device device,
                                           Millis timeout) {
  ProcessGroupOptions options;
  options.name = "bench";
  options.timeout = timeout;
  if (backend == "mpi") {
    // Under mpirun the MPI world defines the ranks; without it MPI runs a 1-rank singleton.
    const int rank = static_cast<int>(env::get_int("OMPI_COMM_WORLD_RANK", 0, INT32_MAX).value_or(0));
    const int world = static_cast<int>(env::get_int("OMPI_COMM_WORLD_SIZE", 1, INT32_MAX).value_or(1));
    return create_process_group("mpi", nullptr, rank, world, Device::cpu(), options);
  }
  const int world = static_cast<int>(
      env::parse_int(require_env("WORLD_SIZE", backend), "WORLD_SIZE", 1, INT32_MAX));
  const int rank = static_cast<int>(
      env::parse_int(require_env("RANK", backend), "RANK", 0, world - 1));
  StoreConnection connection = connect_store_from_env(timeout);
  options.rendezvous_host = connection.host;
  options.rendezvous_port = connection.port;
  return create_process_group(backend, std::move(connection.store), rank, world, device, options);
}

WorkPtr issue(ProcessGroup& group, BenchOp op, Tensor& input, Tensor& output, int iteration) {
  switch (op) {
    case BenchOp::AllReduce: return group.allreduce(input, ReduceOp::Sum);
    case BenchOp::Broadcast: return group.broadcast(input, broadcast_root(iteration, group.size()));
    case BenchOp::AllGather: return group.allgather(input, output);
    case BenchOp::ReduceScatter: return group.reduce_scatter(input, output, ReduceOp::Sum);
  }
  throw InternalError("unhandled BenchOp");
}

int run(int argc, char** argv) {
  const auto parsed = parse_options(argc, argv);
  if (!parsed) return 0;
  const BenchOptions& o = *parsed;
  const Millis timeout{o.timeout_s * 1000};
  // Buffers live on the host unless the backend takes GPU tensors only (then the rank's
  // GPU, as the trainer binds it): auto resolves as for a CPU rank.
#ifdef MTRAIN_HAVE_MPI
  const bool mpi_launched = started_by_mpirun();
#else
  const bool mpi_launched = false;
#endif
  const std::string backend = resolve_backend(o.backend, /*on_gpu=*/false, mpi_launched);
  const Device device = bench_device(backend);
  auto group = create_group(backend, device, timeout);
  const int rank = group->rank();
  const int world = group->size();
  const BenchOp op = o.op;
  const bool in_place = op == BenchOp::AllReduce || op == BenchOp::Broadcast;

  if (rank == 0) {
    std::printf("# mtrain-bench op=%s backend=%s world=%d device=%s dtype=float32 warmup=%lld "
                "iters=%lld\n",
                bench_op_name(op), group->backend_name().c_str(), world, device.str().c_str(),
                static_cast<long long>(o.warmup), static_cast<long long>(o.iters));
    std::printf("# %12s %12s %12s %12s %12s  %s\n", "bytes", "count", "time_us", "algbw_GB/s",
                "busbw_GB/s", "check");
    std::fflush(stdout);
  }
  int64_t failed_rows = 0;
  for (int64_t bytes = o.min_bytes;; bytes *= o.step_factor) {
    const BenchShape shape = bench_shape(op, bytes, world);
    // Host buffers hold the pattern and the result; on CPU they are the collective's own.
    Tensor host_input = Tensor::empty({shape.input_count});
    Tensor host_output = in_place ? host_input : Tensor::empty({shape.output_count});
    Tensor input = host_input.to(device);
    Tensor output = in_place ? input : host_output.to(device);
    std::vector<double> iteration_seconds;
    iteration_seconds.reserve(static_cast<size_t>(o.iters));
    int64_t mismatches = 0;
    for (int64_t it = 0; it < o.warmup + o.iters; ++it) {
      const int iteration = static_cast<int>(it);
      fill_input(op, rank, world, iteration, host_input.data<float>(), shape.input_count);
      if (!device.is_cpu()) {
        input.copy_(host_input);
#ifdef MTRAIN_HAVE_CUDA
        // A copy from pageable memory may return before its DMA ends; the collective
        // would wait for it inside the timed interval.
        cuda::current_stream(device.index).synchronize();
#endif
      }
      const auto start = std::chrono::steady_clock::now();
      issue(*group, op, input, output, iteration)->wait(timeout);
      const auto stop = std::chrono::steady_clock::now();
      if (it >= o.warmup) {
        iteration_seconds.push_back(std::chrono::duration<double>(stop - start).count());
      }
      if (!device.is_cpu()) host_output.copy_(output);
      mismatches += count_mismatches(op, rank, world, iteration, host_output.data<float>(),
                                     shape.output_count);
    }
    // Every rank's mismatches, so rank 0's row covers the whole group.
    Tensor total = Tensor::from_vector<int64_t>({mismatches}, {1}).to(device);
    group->allreduce(total, ReduceOp::Sum)->wait(timeout);
    const int64_t all_mismatches = total.to_vector<int64_t>()[0];
    if (all_mismatches != 0) ++failed_rows;
    if (rank == 0) {
      const double seconds = iteration_time(iteration_seconds, o.median);
      const double algbw = seconds > 0 ? static_cast<double>(shape.bytes) / seconds / 1e9 : 0;
      // Note [One rank in place]: with one rank an in-place allreduce or broadcast leaves
      // its buffer as it was, so a collective that did nothing would pass: say so.
      const std::string check =
          all_mismatches != 0 ? fmt::format("FAIL({} wrong elements)", all_mismatches)
          : in_place && world == 1 ? "n/a(1-rank-in-place)"
                                   : "OK";
      std::printf("  %12lld %12lld %12.1f %12.3f %12.3f  %s\n", static_cast<long long>(shape.bytes),
                  static_cast<long long>(shape.count()), seconds * 1e6, algbw,
                  algbw * bus_bandwidth_factor(op, world), check.c_str());
      std::fflush(stdout);
    }
    if (bytes > o.max_bytes / o.step_factor) break;
  }
  group->barrier()->wait(timeout);
  if (failed_rows != 0) {
    if (rank == 0) {
      std::fprintf(stderr, "mtrain-bench: %lld sizes produced wrong results\n",
                   static_cast<long long>(failed_rows));
    }
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace mtrain::bench

int main(int argc, char** argv) {
  const int code = mtrain::run_main("mtrain-bench", [&] { return mtrain::bench::run(argc, argv); });
#ifdef MTRAIN_HAVE_MPI
  if (code != 0) mtrain::abort_mpi_job_on_error("mtrain-bench", code);  // Note [A failing rank under mpirun]
#endif
  return code;
}
