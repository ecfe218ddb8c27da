// mtrain-bench's checker against results computed here from every rank's input: a
// correct result passes, and one corrupted element, a chunk in the wrong place or a
// stale iteration is caught. Also the size parser and bandwidth factors.
#include <catch2/catch.hpp>

#include <vector>

#include "collectives/bench/bench_pattern.h"
#include "core/error.h"

namespace mtrain::bench {
namespace {

// What the collective must produce on `rank`, computed from every rank's fill_input.
std::vector<float> simulate(BenchOp op, int rank, int world, int iteration, const BenchShape& s) {
  std::vector<std::vector<float>> inputs(world, std::vector<float>(s.input_count));
  for (int r = 0; r < world; ++r) fill_input(op, r, world, iteration, inputs[r].data(), s.input_count);
  std::vector<float> out(s.output_count, 0.0f);
  switch (op) {
    case BenchOp::AllReduce:
      for (int r = 0; r < world; ++r)
        for (int64_t i = 0; i < s.output_count; ++i) out[i] += inputs[r][i];
      break;
    case BenchOp::Broadcast: out = inputs[broadcast_root(iteration, world)]; break;
    case BenchOp::AllGather:
      for (int r = 0; r < world; ++r)
        for (int64_t i = 0; i < s.input_count; ++i) out[r * s.input_count + i] = inputs[r][i];
      break;
    case BenchOp::ReduceScatter:
      for (int r = 0; r < world; ++r)
        for (int64_t i = 0; i < s.output_count; ++i) out[i] += inputs[r][rank * s.output_count + i];
      break;
  }
  return out;
}

TEST_CASE("bench checker accepts the true result and catches corruption", "[unit]") {
  for (BenchOp op : {BenchOp::AllReduce, BenchOp::AllGather, BenchOp::Broadcast, BenchOp::ReduceScatter}) {
    for (int world : {1, 2, 3, 5}) {
      const BenchShape s = bench_shape(op, 4096 + 12, world);
      for (int rank = 0; rank < world; ++rank) {
        CAPTURE(bench_op_name(op), world, rank);
        const int iteration = 7;
        std::vector<float> result = simulate(op, rank, world, iteration, s);
        REQUIRE(count_mismatches(op, rank, world, iteration, result.data(), s.output_count) == 0);

        std::vector<float> corrupted = result;
        corrupted[s.output_count / 2] += 1.0f;
        REQUIRE(count_mismatches(op, rank, world, iteration, corrupted.data(), s.output_count) == 1);

        // The previous iteration's result: inputs change every iteration.
        std::vector<float> stale = simulate(op, rank, world, iteration - 1, s);
        REQUIRE(count_mismatches(op, rank, world, iteration, stale.data(), s.output_count) > 0);
      }
    }
  }
}

TEST_CASE("bench checker catches allgather chunks in the wrong order", "[unit]") {
  const int world = 2;
  const BenchShape s = bench_shape(BenchOp::AllGather, 1024, world);
  std::vector<float> result = simulate(BenchOp::AllGather, 0, world, 3, s);
  std::vector<float> swapped(result.begin() + s.input_count, result.end());
  swapped.insert(swapped.end(), result.begin(), result.begin() + s.input_count);
  // Most elements differ (a few coincide where 2 * pattern(j + c) == pattern(j)).
  REQUIRE(count_mismatches(BenchOp::AllGather, 0, world, 3, swapped.data(), s.output_count) >
          s.output_count / 2);
}

TEST_CASE("bench sizes, shapes and bus bandwidth factors", "[unit]") {
  REQUIRE(parse_byte_size("8", "-b") == 8);
  REQUIRE(parse_byte_size("4K", "-b") == 4096);
  REQUIRE(parse_byte_size("64M", "-e") == 64 << 20);
  REQUIRE(parse_byte_size("1g", "-e") == int64_t{1} << 30);
  REQUIRE_THROWS_WITH(parse_byte_size("12Q", "--max-bytes"), Catch::Contains("--max-bytes") && Catch::Contains("12Q"));
  REQUIRE_THROWS_AS(parse_byte_size("", "-b"), InvalidArgument);
  REQUIRE_THROWS_AS(parse_byte_size("-4K", "-b"), InvalidArgument);
  REQUIRE_THROWS_WITH(parse_bench_op("allreduc"), Catch::Contains("reduce_scatter"));

  REQUIRE(bus_bandwidth_factor(BenchOp::AllReduce, 4) == Approx(1.5));
  REQUIRE(bus_bandwidth_factor(BenchOp::AllGather, 4) == Approx(0.75));
  REQUIRE(bus_bandwidth_factor(BenchOp::ReduceScatter, 2) == Approx(0.5));
  REQUIRE(bus_bandwidth_factor(BenchOp::Broadcast, 8) == Approx(1.0));

  const BenchShape gather = bench_shape(BenchOp::AllGather, 100, 3);  // 25 floats -> 8 per rank
  REQUIRE(gather.input_count == 8);
  REQUIRE(gather.output_count == 24);
  REQUIRE(gather.bytes == 96);
  REQUIRE(gather.count() == 8);  // per rank, as nccl-tests prints it
  const BenchShape scatter = bench_shape(BenchOp::ReduceScatter, 100, 3);
  REQUIRE(scatter.input_count == 24);
  REQUIRE(scatter.output_count == 8);
  REQUIRE(scatter.count() == 8);
  const BenchShape reduce = bench_shape(BenchOp::AllReduce, 10, 3);
  REQUIRE(reduce.input_count == 2);
  REQUIRE(reduce.bytes == 8);
  REQUIRE(reduce.count() == 2);
}

}  // namespace
}  // namespace mtrain::bench

TEST_CASE("bench iteration time: mean by default, median on request", "[unit]") {
  using mtrain::bench::iteration_time;
  // One iteration that lost the CPU moves the mean, not the median.
  const std::vector<double> odd{1.0, 9.0, 2.0, 3.0, 2.0};
  CHECK(iteration_time(odd, false) == Approx(17.0 / 5));
  CHECK(iteration_time(odd, true) == 2.0);
  const std::vector<double> even{4.0, 1.0, 100.0, 2.0};
  CHECK(iteration_time(even, true) == 3.0);  // (2 + 4) / 2
  CHECK(iteration_time({5.0}, true) == 5.0);
  CHECK_THROWS_AS(iteration_time({}, false), mtrain::InvalidArgument);
}
