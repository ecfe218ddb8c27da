#include "collectives/bench/bench_pattern.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "core/env.h"
#include "core/error.h"

// Note [Bench pattern]
// ~~~~~~~~~~~~~~~~~~~~
// Inputs are small integers (1..13 times rank + 1), so every sum over up to thousands of ranks is
// exact in float32 and results compare with ==. They depend on the rank, on the element's position
// in the full (gathered / unscattered) buffer and on the iteration, so a stale buffer, a chunk in
// the wrong place or a missing rank all show up as mismatches. Inputs are rewritten before every
// iteration.

namespace mtrain::bench {
namespace {

// 1..13: see Note [Bench pattern].
float pattern(int64_t global_index, int iteration) {
  return static_cast<float>((global_index * 7 + static_cast<int64_t>(iteration) * 3) % 13 + 1);
}

float rank_sum(int world) { return static_cast<float>(world) * (world + 1) / 2; }

}  // namespace

double iteration_time(std::vector<double> seconds, bool median) {
  if (seconds.empty()) throw InvalidArgument("iteration_time: expected timed iterations, found none");
  if (!median) return std::accumulate(seconds.begin(), seconds.end(), 0.0) / static_cast<double>(seconds.size());
  const size_t mid = seconds.size() / 2;
  std::nth_element(seconds.begin(), seconds.begin() + static_cast<std::ptrdiff_t>(mid), seconds.end());
  if (seconds.size() % 2 == 1) return seconds[mid];
  const double upper = seconds[mid];
  return (*std::max_element(seconds.begin(), seconds.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2;
}

BenchOp parse_bench_op(const std::string& name) {
  for (BenchOp op : {BenchOp::AllReduce, BenchOp::AllGather, BenchOp::Broadcast, BenchOp::ReduceScatter}) {
    if (name == bench_op_name(op)) return op;
  }
  throw InvalidArgument(fmt::format(
      "--op: unknown operation '{}'; expected allreduce, allgather, broadcast or reduce_scatter", name));
}

const char* bench_op_name(BenchOp op) {
  switch (op) {
    case BenchOp::AllReduce: return "allreduce";
    case BenchOp::AllGather: return "allgather";
    case BenchOp::Broadcast: return "broadcast";
    case BenchOp::ReduceScatter: return "reduce_scatter";
  }
  return "?";
}

int64_t parse_byte_size(const std::string& text, const std::string& what) {
  if (text.empty()) {
    throw InvalidArgument(fmt::format("{}: expected a size such as 8, 4K, 64M or 1G, found ''", what));
  }
  int64_t multiplier = 1;
  std::string digits = text;
  switch (text.back()) {
    case 'K': case 'k': multiplier = int64_t{1} << 10; break;
    case 'M': case 'm': multiplier = int64_t{1} << 20; break;
    case 'G': case 'g': multiplier = int64_t{1} << 30; break;
    default: break;
  }
  if (multiplier != 1) digits.pop_back();
  const int64_t limit = (int64_t{1} << 40) / multiplier;  // 1 TiB is plenty for a benchmark
  try {
    return env::parse_int(digits, what, 0, limit) * multiplier;
  } catch (const InvalidArgument&) {
    throw InvalidArgument(fmt::format(
        "{}: expected a size between 0 and 1T such as 8, 4K, 64M or 1G, found '{}'", what, text));
  }
}

double bus_bandwidth_factor(BenchOp op, int world) {
  const double n = world;
  switch (op) {
    case BenchOp::AllReduce: return 2 * (n - 1) / n;
    case BenchOp::AllGather:
    case BenchOp::ReduceScatter: return (n - 1) / n;
    case BenchOp::Broadcast: return 1;
  }
  return 1;
}

BenchShape bench_shape(BenchOp op, int64_t bytes, int world) {
  const int64_t elements = bytes / static_cast<int64_t>(sizeof(float));
  BenchShape shape;
  switch (op) {
    case BenchOp::AllReduce:
    case BenchOp::Broadcast:
      shape.input_count = shape.output_count = elements;
      shape.bytes = elements * 4;
      break;
    case BenchOp::AllGather:
      shape.input_count = elements / world;
      shape.output_count = shape.input_count * world;
      shape.bytes = shape.output_count * 4;
      break;
    case BenchOp::ReduceScatter:
      shape.output_count = elements / world;
      shape.input_count = shape.output_count * world;
      shape.bytes = shape.input_count * 4;
      break;
  }
  return shape;
}

int broadcast_root(int iteration, int world) { return iteration % world; }

void fill_input(BenchOp op, int rank, int world, int iteration, float* input, int64_t input_count) {
  const float scale = static_cast<float>(rank + 1);
  // allgather: this rank's chunk sits at rank * input_count in the gathered buffer.
  const int64_t offset = op == BenchOp::AllGather ? rank * input_count : 0;
  for (int64_t i = 0; i < input_count; ++i) input[i] = scale * pattern(offset + i, iteration);
}

int64_t count_mismatches(BenchOp op, int rank, int world, int iteration, const float* result,
                         int64_t output_count) {
  int64_t mismatches = 0;
  switch (op) {
    case BenchOp::AllReduce: {
      const float sum = rank_sum(world);
      for (int64_t i = 0; i < output_count; ++i) mismatches += result[i] != sum * pattern(i, iteration);
      break;
    }
    case BenchOp::Broadcast: {
      const float scale = static_cast<float>(broadcast_root(iteration, world) + 1);
      for (int64_t i = 0; i < output_count; ++i) mismatches += result[i] != scale * pattern(i, iteration);
      break;
    }
    case BenchOp::AllGather: {
      const int64_t chunk = output_count / world;
      for (int64_t i = 0; i < output_count; ++i) {
        const float scale = static_cast<float>(i / chunk + 1);
        mismatches += result[i] != scale * pattern(i, iteration);
      }
      break;
    }
    case BenchOp::ReduceScatter: {
      const float sum = rank_sum(world);
      const int64_t offset = rank * output_count;
      for (int64_t i = 0; i < output_count; ++i) {
        mismatches += result[i] != sum * pattern(offset + i, iteration);
      }
      break;
    }
  }
  return mismatches;
}

}  // namespace mtrain::bench
