// A worker for the collective tests, started by mtrain-launch (which hosts the store and
// sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, MTRAIN_STORE_TOKEN). Usage:
//
//   collective_test_worker BACKEND suite        every op, reduce op, dtype and size 0, 1, 1023
//                                               (float16/bfloat16: the reductions), plus two
//                                               allreduces in flight at once
//   collective_test_worker BACKEND large        a 64 MiB float32 allreduce (rank 0 prints ms)
//   collective_test_worker BACKEND skip=R       timeout 2 s; rank R never calls allreduce #1
//   collective_test_worker BACKEND skip-rs=R    the same with reduce_scatter #1
//   collective_test_worker BACKEND skip-queued=R  the same, with #1 issued while a 4 MiB
//                                               #0 is still running and both waited with
//                                               wait(group timeout), as the reducer does
//   collective_test_worker BACKEND large-rs     five 4 MiB-per-rank float32 reduce_scatters
//
// Inputs depend on the rank and the element index; each rank computes every rank's
// input itself to check its result element by element. A failure writes
// MTRAIN_ERROR_FILE (for the launcher's report) and exits non-zero.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <unistd.h>

#include "collectives/bootstrap.h"
#include "collectives/process_group.h"
#include "core/env.h"
#include "core/error.h"
#include "core/main_guard.h"
#include "tests/collectives/half_test_values.h"

using namespace mtrain;

namespace {

constexpr int64_t kSizes[] = {0, 1, 1023};

template <class T>
T input_value(int rank, int64_t i);
template <>
float input_value<float>(int rank, int64_t i) {
  return static_cast<float>(((rank * 5 + i * 3) % 17) - 8);
}
template <>
int64_t input_value<int64_t>(int rank, int64_t i) {
  // Beyond 32 bits, so a narrowing anywhere shows.
  return (static_cast<int64_t>((rank * 7 + i) % 13) - 6) * (int64_t{1} << 40) + rank;
}

template <class T>
Tensor make_input(int rank, int64_t n, int64_t offset = 0) {
  std::vector<T> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = input_value<T>(rank, offset + i);
  return Tensor::from_vector(v, {n});
}

template <class T>
T reduce_all(ReduceOp op, int size, int64_t i) {
  T acc = input_value<T>(0, i);
  for (int r = 1; r < size; ++r) {
    const T x = input_value<T>(r, i);
    if (op == ReduceOp::Max) acc = std::max(acc, x);
    else if (op == ReduceOp::Min) acc = std::min(acc, x);
    else acc += x;
  }
  if (op == ReduceOp::Avg) acc /= static_cast<T>(size);
  return acc;
}

template <class T>
void expect_equal(const std::string& what, const Tensor& got, const std::function<T(int64_t)>& want) {
  const T* p = got.data<T>();
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (p[i] != want(i)) {
      throw InternalError(fmt::format("{}: element {} is {}, expected {}", what, i, p[i], want(i)));
    }
  }
}

template <class T>
void run_suite_for(ProcessGroup& pg) {
  const int rank = pg.rank(), size = pg.size();
  const char* dt = dtype_name(DTypeOf<T>::value);
  for (const int64_t n : kSizes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      if (op == ReduceOp::Avg && DTypeOf<T>::value == DType::Int64) continue;
      const std::string what = fmt::format("allreduce {} {} n={}", reduce_op_name(op), dt, n);
      Tensor t = make_input<T>(rank, n);
      pg.allreduce(t, op)->wait();
      expect_equal<T>(what, t, [&](int64_t i) { return reduce_all<T>(op, size, i); });

      Tensor in = make_input<T>(rank, n * size);
      Tensor out = Tensor::zeros({n}, DTypeOf<T>::value);
      pg.reduce_scatter(in, out, op)->wait();
      expect_equal<T>("reduce_scatter " + what.substr(10), out,
                      [&](int64_t i) { return reduce_all<T>(op, size, rank * n + i); });
    }
    for (int root = 0; root < size; ++root) {
      Tensor t = make_input<T>(rank, n);
      pg.broadcast(t, root)->wait();
      expect_equal<T>(fmt::format("broadcast {} n={} root={}", dt, n, root), t,
                      [&](int64_t i) { return input_value<T>(root, i); });
    }
    Tensor in = make_input<T>(rank, n);
    Tensor out = Tensor::zeros({n * size}, DTypeOf<T>::value);
    pg.allgather(in, out)->wait();
    expect_equal<T>(fmt::format("allgather {} n={}", dt, n), out,
                    [&](int64_t i) { return input_value<T>(static_cast<int>(i / std::max<int64_t>(n, 1)), i % std::max<int64_t>(n, 1)); });

    // Rank r contributes n + r elements (rank 0 nothing when n == 0).
    std::vector<int64_t> counts, starts;
    int64_t total = 0;
    for (int r = 0; r < size; ++r) {
      starts.push_back(total);
      counts.push_back(n == 0 ? 0 : n + r);
      total += counts.back();
    }
    Tensor vin = make_input<T>(rank, counts[rank]);
    Tensor vout = Tensor::zeros({total}, DTypeOf<T>::value);
    pg.allgatherv(vin, vout, counts)->wait();
    expect_equal<T>(fmt::format("allgatherv {} n={}", dt, n), vout, [&](int64_t i) {
      int r = size - 1;
      while (starts[r] > i) --r;
      return input_value<T>(r, i - starts[r]);
    });
  }
}

// float16/bfloat16 reductions that need rounding (half_test_values.h explains why the
// expected values do not depend on the backend's reduction order).
void run_half_suite(ProcessGroup& pg) {
  const int rank = pg.rank(), size = pg.size();
  for (DType dtype : {DType::Float16, DType::BFloat16}) {
    const testing::HalfFormat format = testing::half_format(dtype);
    for (const int64_t n : kSizes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
        const std::string what = fmt::format("{} {} n={}", reduce_op_name(op), dtype_name(dtype), n);
        Tensor t = testing::half_input_tensor(format, rank, size, 0, n);
        pg.allreduce(t, op)->wait();
        if (const int64_t i = testing::first_half_mismatch(format, t, 0, op, size); i >= 0) {
          throw InternalError(fmt::format("allreduce {}: element {} is {}, expected {}", what, i,
                                          testing::half_element(format, t, i),
                                          testing::half_expected(format, op, size, i)));
        }
        Tensor in = testing::half_input_tensor(format, rank, size, 0, n * size);
        Tensor out = Tensor::zeros({n}, dtype);
        pg.reduce_scatter(in, out, op)->wait();
        if (const int64_t i = testing::first_half_mismatch(format, out, rank * n, op, size); i >= 0) {
          throw InternalError(fmt::format("reduce_scatter {}: element {} is {}, expected {}", what, i,
                                          testing::half_element(format, out, i),
                                          testing::half_expected(format, op, size, rank * n + i)));
        }
      }
    }
  }
}

// Two allreduces issued before either is waited on: both right, completed in order.
void run_in_flight(ProcessGroup& pg) {
  Tensor a = make_input<float>(pg.rank(), 100000);
  Tensor b = make_input<float>(pg.rank(), 77, 5);
  WorkPtr wa = pg.allreduce(a, ReduceOp::Sum);
  WorkPtr wb = pg.allreduce(b, ReduceOp::Max);
  if (wb->seq() != wa->seq() + 1) throw InternalError("in-flight allreduces got non-consecutive seqs");
  wb->wait();
  if (!wa->is_completed()) throw InternalError("the second allreduce completed before the first");
  wa->wait();
  expect_equal<float>("in-flight allreduce a", a,
                      [&](int64_t i) { return reduce_all<float>(ReduceOp::Sum, pg.size(), i); });
  expect_equal<float>("in-flight allreduce b", b, [&](int64_t i) {
    return reduce_all<float>(ReduceOp::Max, pg.size(), i + 5);
  });
}

void write_error_file(const std::string& message) {
  const auto path = env::get("MTRAIN_ERROR_FILE");
  if (!path || path->empty()) return;
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::ofstream(*path) << nlohmann::json{{"rank", env::get_int("RANK").value_or(0)},
                                         {"message", message},
                                         {"timestamp", now}}
                              .dump()
                       << "\n";
}

int run(int argc, char** argv) {
  if (argc != 3) throw InvalidArgument("usage: collective_test_worker BACKEND suite|large|large-rs|skip=R|skip-rs=R");
  const std::string backend = argv[1], scenario = argv[2];
  const int rank = static_cast<int>(env::get_int("RANK", 0).value_or(0));
  const int size = static_cast<int>(env::get_int("WORLD_SIZE", 1).value_or(1));
  auto store = connect_store_from_env().store;
  ProcessGroupOptions options;
  options.timeout = Millis(scenario.rfind("skip", 0) == 0 ? 2000 : 20000);
  auto pg = create_process_group(backend, store, rank, size, Device::cpu(), options);

  if (scenario == "suite") {
    run_suite_for<float>(*pg);
    run_suite_for<int64_t>(*pg);
    run_half_suite(*pg);
    run_in_flight(*pg);
    pg->barrier()->wait();
  } else if (scenario == "large") {
    const int64_t n = 16 * 1024 * 1024;  // 64 MiB of float32
    Tensor t = make_input<float>(rank, n);
    pg->allreduce(t)->wait();  // warm-up: connections and buffers
    expect_equal<float>("64 MiB allreduce", t,
                        [&](int64_t i) { return reduce_all<float>(ReduceOp::Sum, size, i); });
    constexpr int kIters = 3;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kIters; ++i) pg->allreduce(t)->wait();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
        kIters;
    if (rank == 0) std::printf("allreduce 64 MiB on %d ranks: %.1f ms\n", size, ms);
  } else if (scenario == "large-rs") {
    // Several MiB per rank: more than a socket buffer takes at once, so sends are still
    // queued when a rank has its own chunk (Note [Reduce-scatter through allreduce]).
    const int64_t n = 1024 * 1024;  // 4 MiB of float32 per rank
    for (int iter = 0; iter < 5; ++iter) {
      Tensor in = make_input<float>(rank, n * size, iter);
      Tensor out = Tensor::zeros({n});
      pg->reduce_scatter(in, out, ReduceOp::Sum)->wait();
      expect_equal<float>(fmt::format("reduce_scatter 4 MiB/rank #{}", iter), out,
                          [&](int64_t i) { return reduce_all<float>(ReduceOp::Sum, size, rank * n + i + iter); });
    }
  } else if (scenario.rfind("skip-queued=", 0) == 0) {
    const int skipper = static_cast<int>(env::parse_int(scenario.substr(12), "skip-queued=", 0, size - 1));
    Tensor big = make_input<float>(rank, 1 << 20);
    Tensor t = make_input<float>(rank, 10);
    WorkPtr first = pg->allreduce(big);  // #0 on every rank
    if (rank == skipper) {
      first->wait();
      std::this_thread::sleep_for(std::chrono::seconds(60));  // the launcher stops us
      return 0;
    }
    WorkPtr second = pg->allreduce(t);  // #1, never joined by `skipper`
    try {
      first->wait(options.timeout);
      second->wait(options.timeout);
    } catch (const std::exception& e) {
      write_error_file(e.what());
      throw;
    }
    throw InternalError("operation #1 completed although a rank never called it");
  } else if (scenario.rfind("skip=", 0) == 0 || scenario.rfind("skip-rs=", 0) == 0) {
    const bool rs = scenario.rfind("skip-rs=", 0) == 0;
    const int skipper =
        static_cast<int>(env::parse_int(scenario.substr(rs ? 8 : 5), "skip=", 0, size - 1));
    Tensor t = make_input<float>(rank, 10);
    pg->allreduce(t)->wait();  // #0 on every rank
    if (rank == skipper) {
      std::this_thread::sleep_for(std::chrono::seconds(60));  // the launcher stops us
      return 0;
    }
    try {
      if (rs) {
        Tensor in = make_input<float>(rank, 10 * size);
        Tensor out = Tensor::zeros({10});
        pg->reduce_scatter(in, out, ReduceOp::Sum)->wait();  // #1, never joined by `skipper`
      } else {
        pg->allreduce(t)->wait();  // #1, never joined by `skipper`
      }
    } catch (const std::exception& e) {
      write_error_file(e.what());
      throw;
    }
    throw InternalError("operation #1 completed although a rank never called it");
  } else {
    throw InvalidArgument("unknown scenario '" + scenario + "': expected suite, large or skip=R");
  }
  std::printf("rank %d: OK\n", rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("collective_test_worker", [&] { return run(argc, argv); });
}
