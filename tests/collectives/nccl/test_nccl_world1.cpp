// gpu: the nccl backend end to end with one rank: every operation, reduce op and dtype,
// the stream-side wait, and argument errors. Skips the whole binary without a GPU.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "collectives/process_group.h"
#include "store/store.h"
#include "core/error.h"
#include "tensor/cuda_devices.h"
#include "tests/support/skip.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/stream.h"
#include "tests/support/stream_gate.h"
#endif

#include <limits>
#include <thread>

using namespace mtrain;

namespace {

struct SoloNccl {
  TcpStoreServer server{"127.0.0.1", 0, "t"};
  std::unique_ptr<ProcessGroup> group;
  SoloNccl() {
    if (cuda_info().device_count == 0) testing::skip_test_binary(cuda_summary().c_str());
    auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), "t", Millis(10000));
    ProcessGroupOptions options;
    options.name = "solo";
    options.timeout = Millis(30000);
    group = create_process_group("nccl", store, 0, 1, Device::cuda(0), options);
  }
};

const Device kGpu = Device::cuda(0);

// A host tensor of `dtype` holding small integers 0..n-1 (exact in every dtype).
Tensor iota(DType dtype, int64_t n) {
  Tensor t = Tensor::empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(i % 200) - 50.f;
    switch (dtype) {
      case DType::Float32: t.data<float>()[i] = v; break;
      case DType::Int64: t.data<int64_t>()[i] = static_cast<int64_t>(v); break;
      case DType::Float16: {
        // Integers below 2048 are exact in binary16: build the bits by hand.
        uint16_t bits = 0;
        if (v != 0) {
          const float a = v < 0 ? -v : v;
          int e = 0;
          while ((1 << (e + 1)) <= a) ++e;
          const uint32_t mantissa = static_cast<uint32_t>((a / static_cast<float>(1 << e) - 1.f) * 1024.f);
          bits = static_cast<uint16_t>((v < 0 ? 0x8000 : 0) | ((e + 15) << 10) | mantissa);
        }
        static_cast<uint16_t*>(t.raw_data())[i] = bits;
        break;
      }
      case DType::BFloat16: {
        uint32_t f;
        std::memcpy(&f, &v, 4);
        static_cast<uint16_t*>(t.raw_data())[i] = static_cast<uint16_t>(f >> 16);  // exact
        break;
      }
      default: FAIL("unexpected dtype");
    }
  }
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw_data(), hb.raw_data(), ha.nbytes()) == 0;
}

}  // namespace

TEST_CASE("nccl, one rank: every operation and dtype leaves the data as one rank must") {
  SoloNccl solo;
  ProcessGroup& pg = *solo.group;
  CHECK(pg.backend_name() == "nccl");
  for (const DType dtype : {DType::Float32, DType::Int64, DType::Float16, DType::BFloat16}) {
    DYNAMIC_SECTION(dtype_name(dtype)) {
      const Tensor host = iota(dtype, 1000);
      for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
        if (op == ReduceOp::Avg && dtype == DType::Int64) continue;
        Tensor t = host.to(kGpu);
        pg.allreduce(t, op)->wait();
        CHECK(same_bytes(t, host));
        Tensor out = Tensor::empty({1000}, dtype, kGpu);
        pg.reduce_scatter(host.to(kGpu), out, op)->wait();
        CHECK(same_bytes(out, host));
      }
      Tensor b = host.to(kGpu);
      pg.broadcast(b, 0)->wait();
      CHECK(same_bytes(b, host));
      Tensor gathered = Tensor::empty({1000}, dtype, kGpu);
      pg.allgather(host.to(kGpu), gathered)->wait();
      CHECK(same_bytes(gathered, host));
      Tensor gv = Tensor::empty({1000}, dtype, kGpu);
      pg.allgatherv(host.to(kGpu), gv, {1000})->wait();
      CHECK(same_bytes(gv, host));
    }
  }
  pg.barrier()->wait();
}

// With one rank an in-place allreduce or broadcast is a no-op whether or not it waited
// for anything, so the ordering is checked two ways. Every operation, in place or not,
// must not complete while the caller's stream is held at a gate (the group's stream
// waits for it). An out-of-place allgather must read the input the held stream writes
// after the gate, and the caller's next work (queued after wait_on_current_stream) must
// read its output: the output starts as NaN, so reading it early shows.
TEST_CASE("nccl, one rank: the operation runs after the caller's stream and before its next work") {
  SoloNccl solo;
  ProcessGroup& pg = *solo.group;
  cuda::OwnedStream side(0);
  cuda::StreamGuard guard(side.stream());  // the caller works on a non-default stream
  const auto held_while_gated = [&](const char* what, auto issue) {
    INFO(what);
    testing::StreamGate gate(side.stream().handle());
    WorkPtr work = issue();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK_FALSE(work->is_completed());
    gate.open();
    work->wait(Millis(30000));
    CHECK(work->is_completed());
    CHECK_FALSE(gate.timed_out());
  };
  Tensor t = Tensor::full({4096}, 1.f).to(kGpu);
  Tensor out = Tensor::empty({4096}, DType::Float32, kGpu);
  held_while_gated("allreduce", [&] { return pg.allreduce(t, ReduceOp::Sum); });
  held_while_gated("broadcast", [&] { return pg.broadcast(t, 0); });
  held_while_gated("allgather", [&] { return pg.allgather(t, out); });
  held_while_gated("reduce_scatter", [&] { return pg.reduce_scatter(t, out, ReduceOp::Sum); });
  held_while_gated("barrier", [&] { return pg.barrier(); });

  const int64_t n = int64_t{1} << 26;  // 256 MiB: long enough that an early reader overlaps
  Tensor input = Tensor::empty({n}, DType::Float32, kGpu);
  Tensor output = Tensor::full({n}, std::numeric_limits<float>::quiet_NaN()).to(kGpu);
  Tensor copy = Tensor::empty({n}, DType::Float32, kGpu);
  // CUDA loads a kernel's module at its first launch (lazy loading, the default since
  // CUDA 12.2), and that load waits for the work running on the device, the gate's
  // host function included: on an H200 the first fill_ below waited out the gate. So
  // the fill kernel is launched once before the gate.
  copy.fill_(0.f);
  side.stream().synchronize();
  testing::StreamGate gate(side.stream().handle());
  // None of the calls below may wait for the gated stream; each is timed so that a
  // failure names the one that did.
  const auto returns_at_once = [](const char* call, auto body) {
    const auto start = std::chrono::steady_clock::now();
    body();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    INFO(call << " returned after " << seconds << " s with the caller's stream held");
    CHECK(seconds < 5.0);
  };
  WorkPtr work;
  returns_at_once("fill_", [&] { input.fill_(2.f); });  // queued behind the gate; the allgather must see it
  returns_at_once("allgather", [&] { work = pg.allgather(input, output); });
  returns_at_once("wait_on_current_stream", [&] { work->wait_on_current_stream(); });  // no host wait
  returns_at_once("copy_", [&] { copy.copy_(output); });  // queued after the allgather on the side stream
  gate.open();
  CHECK(copy.to_vector<float>() == std::vector<float>(static_cast<size_t>(n), 2.f));
  work->wait();
  CHECK(work->is_completed());
  CHECK_FALSE(gate.timed_out());
}

TEST_CASE("nccl, one rank: many operations in flight complete in order") {
  SoloNccl solo;
  std::vector<Tensor> ts;
  std::vector<WorkPtr> works;
  for (int i = 0; i < 50; ++i) {
    ts.push_back(Tensor::full({257}, static_cast<float>(i)).to(kGpu));
    works.push_back(solo.group->allreduce(ts.back(), ReduceOp::Sum));
  }
  for (size_t i = 0; i < works.size(); ++i) {
    works[i]->wait(Millis(30000));
    CHECK(works[i]->seq() == i);
    CHECK(ts[i].to_vector<float>() == std::vector<float>(257, static_cast<float>(i)));
  }
  // Empty tensors take a sequence number and complete.
  Tensor empty = Tensor::empty({0}, DType::Float32, kGpu);
  auto w = solo.group->allreduce(empty, ReduceOp::Sum);
  w->wait();
  CHECK(w->seq() == 50);
}

TEST_CASE("nccl: wrong devices, dtypes and sizes are clear errors at the call") {
  SoloNccl solo;
  ProcessGroup& pg = *solo.group;
  Tensor host = Tensor::full({4}, 1.f);
  CHECK_THROWS_WITH(pg.allreduce(host, ReduceOp::Sum), Catch::Contains("the tensor is on cpu"));
  Tensor ints = Tensor::zeros({4}, DType::Int32, kGpu);
  CHECK_THROWS_WITH(pg.broadcast(ints, 0), Catch::Contains("found int32"));
  Tensor i64 = Tensor::zeros({4}, DType::Int64, kGpu);
  CHECK_THROWS_WITH(pg.allreduce(i64, ReduceOp::Avg), Catch::Contains("would truncate"));
  Tensor out = Tensor::empty({3}, DType::Float32, kGpu);
  CHECK_THROWS_WITH(pg.allgather(host.to(kGpu), out), Catch::Contains("expected an output of 1 x 4"));
  CHECK_THROWS_WITH(pg.allgatherv(host.to(kGpu), out, {3}), Catch::Contains("counts[0] = 3"));
  Tensor f = host.to(kGpu);
  CHECK_THROWS_WITH(pg.broadcast(f, 1), Catch::Contains("expected a root in [0, 1)"));
  CHECK_THROWS_AS(create_process_group("nccl", std::make_shared<TcpStore>("127.0.0.1", solo.server.port(), "t"),
                                       0, 1, Device::cuda(cuda_info().device_count)),
                  InvalidArgument);
}
