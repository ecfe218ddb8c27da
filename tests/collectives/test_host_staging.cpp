// HostStagingProcessGroup (Note [Host staging]), registered three times by tag:
//   [unit]    everywhere: CPU tensors pass straight through to the wrapped group (same
//             results, Works and error messages); device checks; the factory's refusals
//             where no GPU is usable;
//   [gpu]     one process on a real GPU: the copy down is ordered after the caller's
//             stream, the Work completes only once the result is back on the device, the
//             wrapped group's errors surface unchanged; every op through a one-rank gloo;
//   [launch]  gpu + multiproc: this binary's hidden [staging-rank] case as two ranks on
//             one GPU under mtrain-launch, every collective checked element by element.
// The gpu cases skip the whole binary without a usable GPU.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/bootstrap.h"
#include "collectives/host_staging.h"
#include "collectives/process_group.h"
#include "store/store.h"
#include "core/env.h"
#include "core/error.h"
#include "tensor/cuda_devices.h"
#include "tests/launcher/launch_harness.h"
#include "tests/support/skip.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/stream.h"
#endif

using namespace mtrain;
using Catch::Matchers::Contains;

namespace {

const Device kGpu = Device::cuda(0);

ProcessGroupOptions named(const std::string& name) {
  ProcessGroupOptions options;
  options.name = name;
  options.timeout = Millis(10000);
  return options;
}

// A one-rank gloo group over a store served in this process.
struct LocalStore {
  TcpStoreServer server{"127.0.0.1", 0, "staging-token"};
  std::shared_ptr<Store> store =
      std::make_shared<TcpStore>("127.0.0.1", server.port(), "staging-token", Millis(5000));
  std::unique_ptr<ProcessGroup> gloo(const std::string& name) {
    return create_process_group("gloo", store, 0, 1, Device::cpu(), named(name));
  }
};

// A wrapped group whose operations the test finishes by hand; it keeps every call's
// Work and the tensors it was given.
class ScriptedGroup final : public ProcessGroup {
 public:
  struct Call {
    std::shared_ptr<Work> work;
    std::vector<Tensor> tensors;
  };

  ScriptedGroup(int rank, int size, std::string backend = "gloo")
      : ProcessGroup(rank, size, named("scripted")), backend_(std::move(backend)) {}

  std::string backend_name() const override { return backend_; }
  WorkPtr allreduce(Tensor& t, ReduceOp) override { return record(OpType::AllReduce, {t}); }
  WorkPtr broadcast(Tensor& t, int root) override {
    check_root(root);
    return record(OpType::Broadcast, {t});
  }
  WorkPtr allgather(const Tensor& in, Tensor& out) override {
    return record(OpType::AllGather, {in, out});
  }
  WorkPtr allgatherv(const Tensor& in, Tensor& out, const std::vector<int64_t>&) override {
    return record(OpType::AllGatherV, {in, out});
  }
  WorkPtr reduce_scatter(const Tensor& in, Tensor& out, ReduceOp) override {
    return record(OpType::ReduceScatter, {in, out});
  }
  WorkPtr barrier() override { return record(OpType::Barrier, {}); }

  std::vector<Call> calls;

 private:
  WorkPtr record(OpType op, std::vector<Tensor> tensors) {
    // Sequence numbers from 100, so that a Work numbered by anyone else shows.
    auto work = std::make_shared<Work>(op, 100 + calls.size());
    calls.push_back({work, std::move(tensors)});
    return work;
  }

  std::string backend_;
};

std::string invalid_argument_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument)";
}

std::vector<float> iota(int64_t n, float start) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = start + static_cast<float>(i);
  return v;
}

}  // namespace

TEST_CASE("host staging: CPU tensors give exactly the wrapped group's results and Works", "[unit]") {
  LocalStore local;
  HostStagingProcessGroup pg(local.gloo("passthrough"), kGpu);
  CHECK(pg.backend_name() == "gloo");
  CHECK(pg.rank() == 0);
  CHECK(pg.size() == 1);
  CHECK(pg.options().name == "passthrough");
  CHECK(pg.device() == kGpu);

  // In a world of one every collective copies its input: outputs start as zeros, so an
  // operation that did not reach the wrapped group shows.
  Tensor t = Tensor::from_vector(iota(5, 1.f), {5});
  WorkPtr w0 = pg.allreduce(t, ReduceOp::Avg);
  w0->wait(Millis(10000));
  CHECK(t.to_vector<float>() == iota(5, 1.f));

  Tensor out = Tensor::zeros({5});
  WorkPtr w1 = pg.allgather(t, out);
  w1->wait(Millis(10000));
  CHECK(out.to_vector<float>() == iota(5, 1.f));

  Tensor vout = Tensor::zeros({5});
  WorkPtr w2 = pg.allgatherv(t, vout, {5});
  w2->wait(Millis(10000));
  CHECK(vout.to_vector<float>() == iota(5, 1.f));

  Tensor rs = Tensor::zeros({5});
  WorkPtr w3 = pg.reduce_scatter(t, rs, ReduceOp::Max);
  w3->wait_on_current_stream();
  CHECK(rs.to_vector<float>() == iota(5, 1.f));

  Tensor ints = Tensor::from_vector<int64_t>({int64_t{1} << 40, -3}, {2});
  WorkPtr w4 = pg.broadcast(ints, 0);
  w4->wait(Millis(10000));
  CHECK(ints.to_vector<int64_t>() == std::vector<int64_t>{int64_t{1} << 40, -3});

  WorkPtr w5 = pg.barrier();
  w5->wait(Millis(10000));
  // The wrapped group numbers the operations.
  CHECK(std::vector<uint64_t>{w0->seq(), w1->seq(), w2->seq(), w3->seq(), w4->seq(), w5->seq()} ==
        std::vector<uint64_t>{0, 1, 2, 3, 4, 5});
}

TEST_CASE("host staging: CPU tensors return the wrapped group's own Work", "[unit]") {
  auto scripted = std::make_unique<ScriptedGroup>(0, 1);
  ScriptedGroup& inner = *scripted;
  HostStagingProcessGroup pg(std::move(scripted), kGpu);
  Tensor t = Tensor::zeros({3});
  Tensor out = Tensor::zeros({3});
  const std::vector<WorkPtr> works{pg.allreduce(t),          pg.broadcast(t, 0),
                                   pg.allgather(t, out),     pg.allgatherv(t, out, {3}),
                                   pg.reduce_scatter(t, out), pg.barrier()};
  REQUIRE(inner.calls.size() == works.size());
  for (size_t i = 0; i < works.size(); ++i) {
    CHECK(works[i] == inner.calls[i].work);
    if (!inner.calls[i].tensors.empty()) CHECK(inner.calls[i].tensors[0].shares_storage_with(t));
  }
  // So the wrapped group's errors reach the caller as they are.
  inner.calls[0].work->mark_failed(std::make_exception_ptr(
      TimeoutError("allreduce #100 in group 'scripted' timed out after 2 s: rank 1 never reached it")));
  CHECK_THROWS_AS(works[0]->wait(), TimeoutError);
  CHECK_THROWS_WITH(works[0]->wait(),
                    "allreduce #100 in group 'scripted' timed out after 2 s: rank 1 never reached it");
}

TEST_CASE("host staging: argument errors are the wrapped group's, word for word", "[unit]") {
  LocalStore local;
  std::unique_ptr<ProcessGroup> plain = local.gloo("same-name");
  HostStagingProcessGroup staged(local.gloo("same-name"), kGpu);
  Tensor four = Tensor::full({4}, 1.f);
  Tensor three = Tensor::zeros({3});
  Tensor two = Tensor::zeros({2});
  Tensor eight = Tensor::zeros({8});
  Tensor bytes = Tensor::zeros({4}, DType::UInt8);
  Tensor ints = Tensor::zeros({4}, DType::Int64);
  Tensor undefined;
  const std::vector<std::pair<std::string, std::function<void(ProcessGroup&)>>> bad_calls{
      {"1 x 4 = 4 elements, found 3", [&](ProcessGroup& g) { g.allgather(four, three); }},
      {"found 3", [&](ProcessGroup& g) { g.reduce_scatter(three, two); }},
      {"expected 1 counts", [&](ProcessGroup& g) { g.allgatherv(four, four, {4, 4}); }},
      {"sum(counts) = 4 elements, found 8", [&](ProcessGroup& g) { g.allgatherv(four, eight, {4}); }},
      {"root in [0, 1), found 1", [&](ProcessGroup& g) { g.broadcast(four, 1); }},
      {"found uint8", [&](ProcessGroup& g) { g.allreduce(bytes); }},
      {"avg of int64 would truncate", [&](ProcessGroup& g) { g.allreduce(ints, ReduceOp::Avg); }},
      {"dtypes differ: float32 vs int64", [&](ProcessGroup& g) { g.allgather(four, ints); }},
      {"undefined", [&](ProcessGroup& g) { g.allreduce(undefined); }},
  };
  for (const auto& [expected, call] : bad_calls) {
    const std::string from_plain = invalid_argument_of([&] { call(*plain); });
    const std::string from_staged = invalid_argument_of([&] { call(staged); });
    INFO(from_plain);
    CHECK_THAT(from_staged, Contains(expected) && Contains("group 'same-name'"));
    CHECK(from_staged == from_plain);
  }
  // Rejected calls take no sequence number, in the wrapped group as without staging.
  CHECK(staged.barrier()->seq() == 0);
}

TEST_CASE("host staging: GPU tensors must be on the group's GPU, all of them", "[unit]") {
  // Borrowed tensors that only claim a device: every check here throws before any
  // memory is touched, so this runs without a GPU.
  std::vector<float> memory(8);
  Tensor on_gpu1 = Tensor::borrow(memory.data(), {4}, DType::Float32, Device::cuda(1));
  Tensor on_gpu0 = Tensor::borrow(memory.data() + 4, {4}, DType::Float32, kGpu);
  Tensor on_cpu = Tensor::zeros({4});
  Tensor undefined;
  auto scripted = std::make_unique<ScriptedGroup>(0, 1);
  ScriptedGroup& inner = *scripted;
  HostStagingProcessGroup pg(std::move(scripted), kGpu);
  CHECK_THROWS_WITH(pg.allreduce(on_gpu1),
                    "allreduce in group 'scripted': this group stages tensors of cuda:0 through "
                    "host memory; the tensor is on cuda:1");
  CHECK_THROWS_WITH(pg.allgather(on_gpu0, on_gpu1), Contains("the output is on cuda:1"));
  CHECK_THROWS_WITH(pg.allgather(on_gpu0, on_cpu),
                    "allgather in group 'scripted': expected the input and the output on one "
                    "device, found the input on cuda:0 and the output on cpu");
  CHECK_THROWS_WITH(pg.reduce_scatter(on_cpu, on_gpu0),
                    Contains("found the output on cuda:0 and the input on cpu"));
  CHECK_THROWS_WITH(pg.allgatherv(on_gpu0, undefined, {4}),
                    "allgatherv in group 'scripted': the output tensor is undefined");
  CHECK_THROWS_AS(pg.broadcast(on_gpu1, 0), InvalidArgument);
  CHECK(inner.calls.empty());  // refused before the wrapped group saw anything
}

TEST_CASE("host staging: the decorator refuses what it cannot stage", "[unit]") {
  CHECK_THROWS_WITH(HostStagingProcessGroup(nullptr, kGpu), Contains("found none"));
  CHECK_THROWS_WITH(HostStagingProcessGroup(std::make_unique<ScriptedGroup>(0, 1), Device::cpu()),
                    Contains("expected a GPU device to stage tensors of, found cpu"));
  CHECK_THROWS_WITH(HostStagingProcessGroup(std::make_unique<ScriptedGroup>(0, 1, "nccl"), kGpu),
                    Contains("found nccl"));
}

TEST_CASE("factory: gloo and mpi on a GPU device stage, and check the GPU first", "[unit]") {
  const CudaInfo& info = cuda_info();
  const Device missing = Device::cuda(info.device_count);  // one past the last GPU
  LocalStore local;
  const std::string expected = info.compiled ? "expected a usable GPU" : "needs a build with CUDA";
  CHECK_THROWS_AS(create_process_group("gloo", local.store, 0, 1, missing), InvalidArgument);
  CHECK_THROWS_WITH(create_process_group("gloo", local.store, 0, 1, missing),
                    Contains("the gloo backend on " + missing.str()) && Contains(expected));
  const auto built = available_backends();
  if (std::find(built.begin(), built.end(), "mpi") != built.end()) {
    // Refused before MPI is initialised: this process never starts MPI.
    CHECK_THROWS_WITH(create_process_group("mpi", nullptr, 0, 1, missing),
                      Contains("the mpi backend on " + missing.str()) && Contains(expected));
  }
  if (info.device_count > 0) {
    std::unique_ptr<ProcessGroup> pg = create_process_group("gloo", local.store, 0, 1, kGpu);
    CHECK(pg->backend_name() == "gloo");
    REQUIRE(dynamic_cast<HostStagingProcessGroup*>(pg.get()) != nullptr);
    CHECK(dynamic_cast<HostStagingProcessGroup*>(pg.get())->device() == kGpu);
  }
  // A CPU device still gets the plain group.
  std::unique_ptr<ProcessGroup> cpu = create_process_group("gloo", local.store, 0, 1, Device::cpu());
  CHECK(dynamic_cast<HostStagingProcessGroup*>(cpu.get()) == nullptr);
}

#ifdef MTRAIN_HAVE_CUDA

namespace {

void require_gpu() {
  if (cuda_info().device_count == 0) testing::skip_test_binary(cuda_summary().c_str());
}

std::string self_path() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

}  // namespace

TEST_CASE("host staging: the input is read after the caller's stream, the result lands before "
          "the Work completes",
          "[gpu]") {
  require_gpu();
  auto scripted = std::make_unique<ScriptedGroup>(0, 1);
  ScriptedGroup& inner = *scripted;
  HostStagingProcessGroup pg(std::move(scripted), kGpu);
  // A non-default current stream: the copy down must follow it, and the copy back must
  // be ordered without relying on the legacy default stream's implicit syncs.
  cuda::OwnedStream caller(0);
  cuda::StreamGuard guard(caller.stream());
  constexpr int64_t n = 1 << 20;
  Tensor t = Tensor::empty({n}, DType::Float32, kGpu);
  t.fill_(3.f);  // queued on the caller's stream, not waited for
  WorkPtr w = pg.allreduce(t);
  REQUIRE(inner.calls.size() == 1);
  const Tensor host = inner.calls[0].tensors[0];
  CHECK(host.device().is_cpu());
  CHECK(host.is_pinned());
  CHECK(host.to_vector<float>() == std::vector<float>(n, 3.f));
  CHECK(w->seq() == inner.calls[0].work->seq());

  // The "collective" writes its result into the host tensor; until the wrapped Work is
  // done, the staged Work is not.
  float* p = host.data<float>();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(i % 1000);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(w->is_completed());
  inner.calls[0].work->mark_completed();
  w->wait(Millis(10000));
  CHECK(w->is_completed());
  const std::vector<float> got = t.to_vector<float>();
  for (int64_t i = 0; i < n; i += 4099) REQUIRE(got[static_cast<size_t>(i)] == static_cast<float>(i % 1000));
  CHECK(got.back() == static_cast<float>((n - 1) % 1000));
}

TEST_CASE("host staging: the wrapped group's error fails the Work unchanged and copies nothing",
          "[gpu]") {
  require_gpu();
  auto scripted = std::make_unique<ScriptedGroup>(0, 2);
  ScriptedGroup& inner = *scripted;
  HostStagingProcessGroup pg(std::move(scripted), kGpu);
  Tensor in = Tensor::full({4}, 2.f).to(kGpu);
  Tensor out = Tensor::full({8}, -1.f).to(kGpu);
  WorkPtr w = pg.allgather(in, out);
  REQUIRE(inner.calls.size() == 1);
  inner.calls[0].tensors[1].fill_(9.f);  // a result that must not be copied back
  const std::string message =
      "allgather #100 in group 'scripted' timed out after 2 s: rank 1 never reached it (its "
      "last operation: #99)";
  inner.calls[0].work->mark_failed(std::make_exception_ptr(TimeoutError(message)));
  CHECK_THROWS_AS(w->wait(Millis(10000)), TimeoutError);
  CHECK_THROWS_WITH(w->wait(), message);
  CHECK_THROWS_WITH(w->wait_on_current_stream(), message);
  CHECK(out.to_vector<float>() == std::vector<float>(8, -1.f));
}

TEST_CASE("host staging: broadcast copies down on the root and back on the others", "[gpu]") {
  require_gpu();
  for (const int rank : {0, 1}) {
    DYNAMIC_SECTION("rank " << rank) {
      auto scripted = std::make_unique<ScriptedGroup>(rank, 2);
      ScriptedGroup& inner = *scripted;
      HostStagingProcessGroup pg(std::move(scripted), kGpu);
      Tensor t = Tensor::from_vector(iota(6, 10.f), {2, 3}).to(kGpu);
      WorkPtr w = pg.broadcast(t, 0);
      REQUIRE(inner.calls.size() == 1);
      Tensor host = inner.calls[0].tensors[0];
      CHECK(host.shape() == Shape{2, 3});
      if (rank == 0) CHECK(host.to_vector<float>() == iota(6, 10.f));
      host.fill_(-4.f);  // what the root's values would have been replaced with on rank 1
      inner.calls[0].work->mark_completed();
      w->wait(Millis(10000));
      CHECK(t.to_vector<float>() == (rank == 0 ? iota(6, 10.f) : std::vector<float>(6, -4.f)));
    }
  }
}

TEST_CASE("host staging: every op on GPU tensors through a one-rank gloo group", "[gpu]") {
  require_gpu();
  LocalStore local;
  std::unique_ptr<ProcessGroup> pg =
      create_process_group("gloo", local.store, 0, 1, kGpu, named("one-gpu"));
  Tensor t = Tensor::from_vector(iota(1000, -500.f), {10, 100}).to(kGpu);
  pg->allreduce(t, ReduceOp::Avg)->wait();
  CHECK(t.to_vector<float>() == iota(1000, -500.f));
  CHECK(t.device() == kGpu);

  Tensor ints = Tensor::from_vector<int64_t>({int64_t{1} << 41, 7, -9}, {3}).to(kGpu);
  pg->allreduce(ints, ReduceOp::Min)->wait_on_current_stream();
  CHECK(ints.to_vector<int64_t>() == std::vector<int64_t>{int64_t{1} << 41, 7, -9});

  Tensor out = Tensor::zeros({1000}, DType::Float32, kGpu);
  pg->allgather(t, out)->wait();
  CHECK(out.to_vector<float>() == iota(1000, -500.f));

  Tensor vout = Tensor::zeros({1000}, DType::Float32, kGpu);
  pg->allgatherv(t, vout, {1000})->wait();
  CHECK(vout.to_vector<float>() == iota(1000, -500.f));

  Tensor rs = Tensor::zeros({1000}, DType::Float32, kGpu);
  pg->reduce_scatter(t, rs)->wait();
  CHECK(rs.to_vector<float>() == iota(1000, -500.f));

  Tensor empty = Tensor::empty({0}, DType::Float32, kGpu);
  pg->allreduce(empty)->wait();

  // Issued before any is waited on: completed in issue order, a CPU tensor in between.
  Tensor a = Tensor::from_vector(iota(300000, 0.f), {300000}).to(kGpu);
  Tensor on_cpu = Tensor::full({5}, 1.5f);
  Tensor b = Tensor::from_vector(iota(7, 1.f), {7}).to(kGpu);
  WorkPtr wa = pg->allreduce(a, ReduceOp::Max);
  WorkPtr wc = pg->allreduce(on_cpu);
  WorkPtr wb = pg->allreduce(b);
  CHECK(wc->seq() == wa->seq() + 1);
  CHECK(wb->seq() == wc->seq() + 1);
  wb->wait();
  CHECK(wa->is_completed());
  CHECK(a.to_vector<float>() == iota(300000, 0.f));
  CHECK(b.to_vector<float>() == iota(7, 1.f));
  wc->wait();
  CHECK(on_cpu.to_vector<float>() == std::vector<float>(5, 1.5f));
  pg->barrier()->wait();
}

namespace {

// Rank- and index-dependent inputs, exact in float32 and float16 sums of two ranks.
template <class T>
T input_value(int rank, int64_t i) {
  return static_cast<T>(((rank * 5 + i * 3) % 17) - 8);
}

template <class T>
Tensor input_on_gpu(int rank, int64_t n, int64_t offset = 0) {
  std::vector<T> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = input_value<T>(rank, offset + i);
  return Tensor::from_vector(v, {n}).to(kGpu);
}

template <class T>
void expect_elements(const std::string& what, const Tensor& got, const std::function<T(int64_t)>& want) {
  REQUIRE(got.device() == kGpu);
  const std::vector<T> values = got.to_vector<T>();
  for (int64_t i = 0; i < static_cast<int64_t>(values.size()); ++i) {
    if (values[static_cast<size_t>(i)] != want(i)) {
      FAIL(what << ": element " << i << " is " << values[static_cast<size_t>(i)] << ", expected "
                << want(i));
    }
  }
}

template <class T>
void check_every_collective(ProcessGroup& pg) {
  const int rank = pg.rank(), size = pg.size();
  const char* dt = dtype_name(DTypeOf<T>::value);
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{1023}}) {
    for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
      auto reduced = [&](int64_t i) {
        T acc = input_value<T>(0, i);
        for (int r = 1; r < size; ++r) {
          const T x = input_value<T>(r, i);
          acc = op == ReduceOp::Max ? std::max(acc, x) : op == ReduceOp::Min ? std::min(acc, x) : acc + x;
        }
        return acc;
      };
      Tensor t = input_on_gpu<T>(rank, n);
      pg.allreduce(t, op)->wait_on_current_stream();
      expect_elements<T>(fmt::format("allreduce {} {} n={}", reduce_op_name(op), dt, n), t, reduced);

      Tensor in = input_on_gpu<T>(rank, n * size);
      Tensor out = Tensor::zeros({n}, DTypeOf<T>::value, kGpu);
      pg.reduce_scatter(in, out, op)->wait();
      expect_elements<T>(fmt::format("reduce_scatter {} {} n={}", reduce_op_name(op), dt, n), out,
                         [&](int64_t i) { return reduced(rank * n + i); });
    }
    for (int root = 0; root < size; ++root) {
      Tensor t = input_on_gpu<T>(rank, n);
      pg.broadcast(t, root)->wait();
      expect_elements<T>(fmt::format("broadcast {} n={} root={}", dt, n, root), t,
                         [&](int64_t i) { return input_value<T>(root, i); });
    }
    Tensor in = input_on_gpu<T>(rank, n);
    Tensor out = Tensor::zeros({n * size}, DTypeOf<T>::value, kGpu);
    pg.allgather(in, out)->wait();
    expect_elements<T>(fmt::format("allgather {} n={}", dt, n), out, [&](int64_t i) {
      return input_value<T>(static_cast<int>(i / n), i % n);
    });

    // Rank r contributes n + r elements (nothing at all when n == 0).
    std::vector<int64_t> counts, starts;
    int64_t total = 0;
    for (int r = 0; r < size; ++r) {
      starts.push_back(total);
      counts.push_back(n == 0 ? 0 : n + r);
      total += counts.back();
    }
    Tensor vin = input_on_gpu<T>(rank, counts[static_cast<size_t>(rank)]);
    Tensor vout = Tensor::zeros({total}, DTypeOf<T>::value, kGpu);
    pg.allgatherv(vin, vout, counts)->wait();
    expect_elements<T>(fmt::format("allgatherv {} n={}", dt, n), vout, [&](int64_t i) {
      int r = size - 1;
      while (starts[static_cast<size_t>(r)] > i) --r;
      return input_value<T>(r, i - starts[static_cast<size_t>(r)]);
    });
  }
}

}  // namespace

// One rank of the [launch] case; hidden, so it only runs when asked for by tag.
TEST_CASE("host staging rank: every collective on GPU tensors", "[.][staging-rank]") {
  const int rank = static_cast<int>(env::get_int("RANK", 0).value_or(0));
  const int size = static_cast<int>(env::get_int("WORLD_SIZE", 1).value_or(1));
  ProcessGroupOptions options;
  options.timeout = Millis(30000);
  std::unique_ptr<ProcessGroup> pg =
      create_process_group("gloo", connect_store_from_env().store, rank, size, kGpu, options);
  REQUIRE(pg->backend_name() == "gloo");
  check_every_collective<float>(*pg);
  check_every_collective<int64_t>(*pg);
  pg->barrier()->wait();
  std::printf("rank %d: OK\n", rank);
  std::fflush(stdout);
}

TEST_CASE("host staging: two ranks on one GPU through gloo, every collective element by element",
          "[launch]") {
  require_gpu();
  testing::TempDir dir;
  const auto r = testing::run_launcher({"--nproc_per_node=2", self_path(), "[staging-rank]"},
                                       dir.path(), 150);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("rank 0: OK"));
  CHECK_THAT(r.out, Contains("rank 1: OK"));
}

#endif  // MTRAIN_HAVE_CUDA
