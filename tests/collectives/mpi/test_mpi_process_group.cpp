// The MPI backend under mpirun (-np 2, 3 and 4): every collective and reduce op on
// float32 and int64 (reductions also on float16 and bfloat16), sizes 0, 1, odd and
// large, checked element by element against values computed here from every rank's
// input; operations in flight; bad input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "collectives/mpi/mpi_process_group.h"
#include "core/error.h"
#include "tests/collectives/half_test_values.h"

namespace mtrain {
namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}
int world_rank() { return env_int("OMPI_COMM_WORLD_RANK", 0); }
int world_size() { return env_int("OMPI_COMM_WORLD_SIZE", 1); }

std::unique_ptr<ProcessGroup> make_group(const std::string& name) {
  ProcessGroupOptions options;
  options.name = name;
  options.timeout = Millis(60'000);
  return create_mpi_process_group(world_rank(), world_size(), options);
}

// Rank-dependent, element-dependent values with negatives, so that max and min pick
// different ranks for different elements; int64 values exceed 32 bits.
template <class T>
T value(int rank, int64_t i);
template <>
float value<float>(int rank, int64_t i) {
  return static_cast<float>((i + 3 * rank) % 17) - 8.0f;
}
template <>
int64_t value<int64_t>(int rank, int64_t i) {
  return ((i * 5 + 7 * rank) % 23) - 11 + (static_cast<int64_t>(rank) << 33);
}

template <class T>
DType dtype_of();
template <>
DType dtype_of<float>() { return DType::Float32; }
template <>
DType dtype_of<int64_t>() { return DType::Int64; }

template <class T>
Tensor rank_tensor(int rank, int64_t offset, int64_t n) {
  Tensor t = Tensor::empty({n}, dtype_of<T>());
  T* p = t.data<T>();
  for (int64_t i = 0; i < n; ++i) p[i] = value<T>(rank, offset + i);
  return t;
}

template <class T>
T reduce_expected(ReduceOp op, int64_t i, int size) {
  T acc = value<T>(0, i);
  for (int r = 1; r < size; ++r) {
    const T v = value<T>(r, i);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg: acc += v; break;
      case ReduceOp::Max: acc = std::max(acc, v); break;
      case ReduceOp::Min: acc = std::min(acc, v); break;
    }
  }
  if (op == ReduceOp::Avg) acc /= static_cast<T>(size);
  return acc;
}

// Counting mismatches instead of one REQUIRE per element keeps 16M-element checks fast.
template <class T>
int64_t mismatches_against(const Tensor& t, int64_t offset, ReduceOp op, int size) {
  const T* p = t.data<T>();
  int64_t wrong = 0;
  for (int64_t i = 0; i < t.numel(); ++i) wrong += p[i] != reduce_expected<T>(op, offset + i, size);
  return wrong;
}

const std::vector<int64_t> kSizes{0, 1, 1001, 16 << 20};  // the last is 64 MiB of float32
// avg only for float32: integer averages are rejected (they would truncate).
template <class T>
std::vector<ReduceOp> reduce_ops() {
  if (sizeof(T) == 8) return {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min};
  return {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};
}

template <class T>
void check_allreduce(ProcessGroup& group) {
  for (int64_t n : kSizes) {
    if (sizeof(T) == 8 && n > (1 << 20)) n = (1 << 20) + 3;  // int64: 8 MiB is enough
    for (ReduceOp op : reduce_ops<T>()) {
      CAPTURE(n, reduce_op_name(op));
      Tensor t = rank_tensor<T>(group.rank(), 0, n);
      group.allreduce(t, op)->wait();
      REQUIRE(mismatches_against<T>(t, 0, op, group.size()) == 0);
    }
  }
}

TEST_CASE("mpi allreduce: every reduce op (avg on float32), float32 and int64, sizes 0/1/odd/64 MiB", "[mpi]") {
  auto group = make_group("allreduce");
  REQUIRE(group->backend_name() == "mpi");
  REQUIRE(group->size() == world_size());
  check_allreduce<float>(*group);
  check_allreduce<int64_t>(*group);
}

template <class T>
void check_reduce_scatter(ProcessGroup& group) {
  for (int64_t chunk : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{(1 << 20) + 1}}) {
    for (ReduceOp op : reduce_ops<T>()) {
      CAPTURE(chunk, reduce_op_name(op));
      Tensor input = rank_tensor<T>(group.rank(), 0, chunk * group.size());
      Tensor output = Tensor::empty({chunk}, dtype_of<T>());
      group.reduce_scatter(input, output, op)->wait();
      REQUIRE(mismatches_against<T>(output, chunk * group.rank(), op, group.size()) == 0);
    }
  }
}

TEST_CASE("mpi reduce_scatter: every reduce op, float32 and int64", "[mpi]") {
  auto group = make_group("reduce_scatter");
  check_reduce_scatter<float>(*group);
  check_reduce_scatter<int64_t>(*group);
}

template <class T>
void check_broadcast_and_allgather(ProcessGroup& group) {
  const int size = group.size();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{(1 << 20) + 1}}) {
    CAPTURE(n);
    for (int root = 0; root < size; ++root) {
      Tensor t = rank_tensor<T>(group.rank(), 0, n);
      group.broadcast(t, root)->wait();
      const Tensor expected = rank_tensor<T>(root, 0, n);
      REQUIRE(std::memcmp(t.raw_data(), expected.raw_data(), t.nbytes()) == 0);
    }
    // Each rank's chunk sits at rank * n, with values that depend on the position.
    Tensor input = rank_tensor<T>(group.rank(), group.rank() * n, n);
    Tensor output = Tensor::empty({n * size}, dtype_of<T>());
    group.allgather(input, output)->wait();
    for (int r = 0; r < size; ++r) {
      const Tensor expected = rank_tensor<T>(r, r * n, n);
      REQUIRE(std::memcmp(static_cast<char*>(output.raw_data()) + r * n * sizeof(T),
                          expected.raw_data(), expected.nbytes()) == 0);
    }
  }
}

// Half-precision sums that need rounding (Note [Half-precision reductions]); the inputs
// make the expected values independent of MPI's reduction order (half_test_values.h).
// The large sizes go through MPI's segmented algorithms, which call the user operator
// on pieces of the buffer.
TEST_CASE("mpi float16/bfloat16 allreduce and reduce_scatter, every reduce op, rounded to nearest even", "[mpi]") {
  using testing::first_half_mismatch;
  using testing::half_input_tensor;
  auto group = make_group("half");
  const int rank = group->rank(), size = group->size();
  REQUIRE(size <= 6);
  for (DType dtype : {DType::Float16, DType::BFloat16}) {
    const testing::HalfFormat format = testing::half_format(dtype);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{(1 << 20) + 3}}) {
        CAPTURE(dtype_name(dtype), reduce_op_name(op), n);
        Tensor t = half_input_tensor(format, rank, size, 0, n);
        group->allreduce(t, op)->wait();
        REQUIRE(first_half_mismatch(format, t, 0, op, size) == -1);
      }
      for (int64_t chunk : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{(1 << 18) + 1}}) {
        CAPTURE(dtype_name(dtype), reduce_op_name(op), chunk);
        Tensor input = half_input_tensor(format, rank, size, 0, chunk * size);
        Tensor output = Tensor::empty({chunk}, dtype);
        group->reduce_scatter(input, output, op)->wait();
        REQUIRE(first_half_mismatch(format, output, chunk * rank, op, size) == -1);
      }
    }
  }
}

TEST_CASE("mpi broadcast from every root and allgather, float32 and int64", "[mpi]") {
  auto group = make_group("broadcast_allgather");
  check_broadcast_and_allgather<float>(*group);
  check_broadcast_and_allgather<int64_t>(*group);
}

TEST_CASE("mpi broadcast and allgather move bfloat16 buffers bit for bit", "[mpi]") {
  auto group = make_group("bf16");
  const int64_t n = 257;
  Tensor t = Tensor::empty({n}, DType::BFloat16);
  auto* bits = static_cast<uint16_t*>(t.raw_data());
  for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>(i * 31 + group->rank() * 1000);
  Tensor gathered = Tensor::empty({n * group->size()}, DType::BFloat16);
  group->allgather(t, gathered)->wait();
  group->broadcast(t, group->size() - 1)->wait();
  const auto* g = static_cast<const uint16_t*>(gathered.raw_data());
  for (int r = 0; r < group->size(); ++r) {
    for (int64_t i = 0; i < n; ++i) REQUIRE(g[r * n + i] == static_cast<uint16_t>(i * 31 + r * 1000));
  }
  for (int64_t i = 0; i < n; ++i) {
    REQUIRE(bits[i] == static_cast<uint16_t>(i * 31 + (group->size() - 1) * 1000));
  }
}

TEST_CASE("mpi allgatherv with per-rank sizes, one of them empty", "[mpi]") {
  auto group = make_group("allgatherv");
  const int size = group->size();
  std::vector<int64_t> counts(size);
  for (int r = 0; r < size; ++r) counts[r] = r == 1 ? 0 : 2 * r + 3;
  int64_t offset = 0;
  for (int r = 0; r < group->rank(); ++r) offset += counts[r];
  Tensor input = rank_tensor<float>(group->rank(), offset, counts[group->rank()]);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  Tensor output = Tensor::empty({total});
  group->allgatherv(input, output, counts)->wait();
  const float* p = output.data<float>();
  int64_t at = 0;
  for (int r = 0; r < size; ++r) {
    for (int64_t i = 0; i < counts[r]; ++i, ++at) REQUIRE(p[at] == value<float>(r, at));
  }
  REQUIRE(at == total);
}

TEST_CASE("mpi allgather, allgatherv and reduce_scatter whose input is a view of their output", "[mpi]") {
  // MPI forbids overlapping send and receive buffers; the backend copies such an input.
  auto group = make_group("aliasing");
  const int rank = group->rank(), size = group->size();
  const int64_t n = 1000;
  Tensor gathered = Tensor::zeros({n * size});
  Tensor mine = gathered.narrow0(rank * n, n);
  mine.copy_(rank_tensor<float>(rank, rank * n, n));
  group->allgather(mine, gathered)->wait();
  const float* g = gathered.data<float>();
  for (int64_t i = 0; i < n * size; ++i) REQUIRE(g[i] == value<float>(static_cast<int>(i / n), i));

  // allgatherv with every rank sending from the front of its output, rank 0's slot,
  // which MPI writes: the input must be copied first (100000 elements: with the input
  // passed as is, Open MPI's algorithm at this size delivered rank 0's data as rank 1's).
  const int64_t big = 100000;
  const std::vector<int64_t> counts(static_cast<size_t>(size), big);
  Tensor out = Tensor::zeros({big * size});
  Tensor front = out.narrow0(0, big);
  front.copy_(rank_tensor<float>(rank, rank * big, big));
  group->allgatherv(front, out, counts)->wait();
  const float* o = out.data<float>();
  for (int64_t i = 0; i < big * size; ++i) REQUIRE(o[i] == value<float>(static_cast<int>(i / big), i));

  Tensor whole = rank_tensor<float>(rank, 0, n * size);
  Tensor chunk = whole.narrow0(rank * n, n);
  group->reduce_scatter(whole, chunk, ReduceOp::Sum)->wait();
  const float* c = chunk.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    float expected = 0.0f;
    for (int r = 0; r < size; ++r) expected += value<float>(r, rank * n + i);
    REQUIRE(c[i] == expected);
  }
}

TEST_CASE("mpi operations in flight complete in issue order, across two groups", "[mpi]") {
  auto first = make_group("in_flight_a");
  auto second = make_group("in_flight_b");
  const int64_t n = 100'003;
  // The max runs on the sum's result: issued out of order it would see the raw inputs.
  Tensor t = rank_tensor<float>(first->rank(), 0, n);
  Tensor other = rank_tensor<float>(first->rank(), 0, n);
  WorkPtr sum = first->allreduce(t, ReduceOp::Sum);
  WorkPtr on_other_group = second->allreduce(other, ReduceOp::Min);
  WorkPtr max = first->allreduce(t, ReduceOp::Max);
  max->wait();
  REQUIRE(sum->is_completed());
  REQUIRE(on_other_group->is_completed());
  sum->wait();
  on_other_group->wait();
  REQUIRE(sum->seq() + 1 == max->seq());
  REQUIRE(mismatches_against<float>(t, 0, ReduceOp::Sum, first->size()) == 0);
  REQUIRE(mismatches_against<float>(other, 0, ReduceOp::Min, first->size()) == 0);
  first->barrier()->wait(Millis(30'000));
}

TEST_CASE("mpi backend rejects bad input at the call with clear errors", "[mpi]") {
  const int rank = world_rank();
  const int size = world_size();
  ProcessGroupOptions options;
  options.name = "bad";
  REQUIRE_THROWS_WITH(create_mpi_process_group(rank, size + 1, options),
                      Catch::Contains("MPI_COMM_WORLD") && Catch::Contains("mpirun -np"));
  auto group = make_group("bad_input");
  Tensor input = Tensor::zeros({5});
  Tensor wrong = Tensor::zeros({5 * size + 1});
  REQUIRE_THROWS_AS(group->allgather(input, wrong), InvalidArgument);
  REQUIRE_THROWS_AS(group->reduce_scatter(wrong, input), InvalidArgument);
  REQUIRE_THROWS_WITH(group->broadcast(input, size), Catch::Contains("root"));
  Tensor bytes = Tensor::zeros({4}, DType::UInt8);
  REQUIRE_THROWS_WITH(group->allreduce(bytes), Catch::Contains("unsupported dtype uint8") &&
                                                   Catch::Contains("float16 or bfloat16"));
  Tensor half_in = Tensor::zeros({4 * size}, DType::Float16);
  Tensor bf16_out = Tensor::zeros({4}, DType::BFloat16);
  REQUIRE_THROWS_WITH(group->reduce_scatter(half_in, bf16_out), Catch::Contains("dtypes differ"));
  Tensor counters = Tensor::zeros({5}, DType::Int64);
  REQUIRE_THROWS_WITH(group->allreduce(counters, ReduceOp::Avg), Catch::Contains("truncate"));
  Tensor ints = Tensor::zeros({5 * size}, DType::Int64);
  REQUIRE_THROWS_WITH(group->allgather(input, ints), Catch::Contains("dtypes differ"));
  // Nothing was queued by the rejected calls: the group still agrees with its peers.
  Tensor t = Tensor::full({3}, 1.0f);
  group->allreduce(t)->wait();
  REQUIRE(t.data<float>()[2] == static_cast<float>(size));
}

}  // namespace
}  // namespace mtrain
