// What mtrain-bench sends and expects: the operations, their sizes and bandwidth factors, and the
// rank- and iteration-dependent input pattern with its checker (Note [Bench pattern] in
// bench_pattern.cpp: exact in float32, so results compare with ==). Pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mtrain::bench {

enum class BenchOp { AllReduce, AllGather, Broadcast, ReduceScatter };
BenchOp parse_bench_op(const std::string& name);  // InvalidArgument listing the names
const char* bench_op_name(BenchOp op);

// "8", "4K", "64M", "1G" (binary multiples); InvalidArgument naming `what` otherwise.
int64_t parse_byte_size(const std::string& text, const std::string& what);

// The time a row reports from its timed iterations: the mean (nccl-tests' definition,
// the default) or the median (--median), which a few iterations that lost the CPU on a
// shared machine cannot move. InvalidArgument for an empty list.
double iteration_time(std::vector<double> seconds, bool median);

// busbw = algbw * factor (nccl-tests): allreduce 2(n-1)/n, allgather and
// reduce_scatter (n-1)/n, broadcast 1.
double bus_bandwidth_factor(BenchOp op, int world);

// float32 element counts for one row of `bytes`. For allgather `bytes` is the gathered
// output and for reduce_scatter the full input, rounded down to a multiple of
// world * 4 bytes.
struct BenchShape {
  int64_t input_count = 0;
  int64_t output_count = 0;  // allreduce/broadcast: in place, equal to input_count
  int64_t bytes = 0;         // the size the row reports
  // nccl-tests' "count" column: elements per rank (allgather's input, reduce_scatter's
  // output), so rows compare with theirs.
  int64_t count() const { return input_count < output_count ? input_count : output_count; }
};
BenchShape bench_shape(BenchOp op, int64_t bytes, int world);

// The broadcast root of an iteration: rotates so every rank sends.
int broadcast_root(int iteration, int world);

// Fills this rank's input (input_count elements) for `iteration`.
void fill_input(BenchOp op, int rank, int world, int iteration, float* input, int64_t input_count);

// Number of elements of the result (output_count elements; the in-place buffer for
// allreduce/broadcast) that differ from what the collective must produce.
int64_t count_mismatches(BenchOp op, int rank, int world, int iteration, const float* result,
                         int64_t output_count);

}  // namespace mtrain::bench
