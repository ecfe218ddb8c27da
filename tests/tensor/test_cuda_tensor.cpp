// gpu: CUDA tensors (copies, zero_/fill_, streams) and the caching device and pinned
// allocators on a real GPU. Skips the whole binary without one.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "tensor/cuda_memory.h"
#include "tensor/cuda_devices.h"
#include "tensor/tensor.h"
#include "tests/support/skip.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/stream.h"
#include "tests/support/stream_gate.h"
#endif

using namespace mtrain;

#ifdef MTRAIN_HAVE_CUDA

namespace {
void require_gpu() {
  if (cuda_info().device_count == 0) testing::skip_test_binary(cuda_summary().c_str());
}
}  // namespace

TEST_CASE("host -> device -> host copies round-trip every dtype") {
  require_gpu();
  const Device gpu = Device::cuda(0);
  std::vector<float> f(1000);
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i) * 0.5f - 100.f;
  const Tensor hf = Tensor::from_vector(f, {10, 100});
  const Tensor df = hf.to(gpu);
  CHECK(df.device() == gpu);
  CHECK(df.shape() == hf.shape());
  CHECK(df.to_vector<float>() == f);

  std::vector<int64_t> i64{INT64_MIN, -1, 0, 1, INT64_MAX};
  CHECK(Tensor::from_vector(i64, {5}).to(gpu).to_vector<int64_t>() == i64);

  // Half types move as raw bytes: compare the bits.
  for (const DType d : {DType::Float16, DType::BFloat16}) {
    Tensor h = Tensor::empty({257}, d);
    auto* bits = static_cast<uint16_t*>(h.raw_data());
    for (int i = 0; i < 257; ++i) bits[i] = static_cast<uint16_t>(i * 251);
    const Tensor back = h.to(gpu).to(Device::cpu());
    CHECK(std::memcmp(back.raw_data(), h.raw_data(), h.nbytes()) == 0);
  }
}

TEST_CASE("device -> device copy, clone, views and empty tensors") {
  require_gpu();
  const Device gpu = Device::cuda(0);
  const Tensor src = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}).to(gpu);
  Tensor dst = Tensor::empty({6}, DType::Float32, gpu);
  dst.copy_(src);
  CHECK(dst.to_vector<float>() == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(src.clone().to_vector<float>() == std::vector<float>{1, 2, 3, 4, 5, 6});
  // A view at an offset copies from the right place.
  CHECK(src.narrow0(1, 1).to_vector<float>() == std::vector<float>{4, 5, 6});
  Tensor empty = Tensor::empty({0, 3}, DType::Float32, gpu);
  empty.copy_(Tensor::empty({0, 3}));
  CHECK(empty.to_vector<float>().empty());
}

TEST_CASE("zero_ and fill_ on the device") {
  require_gpu();
  Tensor t = Tensor::full({1000}, 7.f).to(Device::cuda(0));
  t.zero_();
  CHECK(t.to_vector<float>() == std::vector<float>(1000, 0.f));
  t.fill_(-2.5f);
  CHECK(t.to_vector<float>() == std::vector<float>(1000, -2.5f));
  CHECK(Tensor::zeros({3}, DType::Int64, Device::cuda(0)).to_vector<int64_t>() ==
        std::vector<int64_t>{0, 0, 0});
}

TEST_CASE("the allocator's steady state makes no cudaMalloc") {
  require_gpu();
  auto step = [] {
    Tensor a = Tensor::empty({256, 1024}, DType::Float32, Device::cuda(0));
    Tensor b = Tensor::empty({3, 5}, DType::Int64, Device::cuda(0));
    Tensor c = Tensor::empty({4 << 20}, DType::Float16, Device::cuda(0));
    a.fill_(1.f);
    b.zero_();
    c.zero_();
  };
  step();
  const auto before = cuda_memory_stats(0);
  for (int i = 0; i < 20; ++i) step();
  const auto after = cuda_memory_stats(0);
  CHECK(after.backend_allocs == before.backend_allocs);
  CHECK(after.cache_hits >= before.cache_hits + 60);
  CHECK(after.in_use_bytes == before.in_use_bytes);
  cuda_release_cached_memory(0);
  CHECK(cuda_memory_stats(0).cached_bytes == 0);
}

TEST_CASE("pinned host tensors: asynchronous copies and cached blocks") {
  require_gpu();
  Tensor pinned = Tensor::empty_pinned({1 << 16});
  CHECK(pinned.is_pinned());
  CHECK(pinned.device().is_cpu());
  float* p = pinned.data<float>();
  for (int i = 0; i < (1 << 16); ++i) p[i] = static_cast<float>(i);
  Tensor dev = Tensor::empty({1 << 16}, DType::Float32, Device::cuda(0));
  dev.copy_(pinned, /*non_blocking=*/true);
  Tensor back = Tensor::empty_pinned({1 << 16});
  back.copy_(dev, /*non_blocking=*/true);
  cuda::current_stream(0).synchronize();
  CHECK(std::memcmp(back.raw_data(), pinned.raw_data(), pinned.nbytes()) == 0);
  const auto before = pinned_memory_stats();
  { Tensor again = Tensor::empty_pinned({1 << 16}); }
  { Tensor again = Tensor::empty_pinned({1 << 16}); }
  CHECK(pinned_memory_stats().backend_allocs == before.backend_allocs + 1);
}

TEST_CASE("work on a side stream is ordered through events and record_stream") {
  require_gpu();
  cuda::OwnedStream side(0);
  Tensor t = Tensor::empty({1 << 20}, DType::Float32, Device::cuda(0));
  t.fill_(3.f);  // on the default stream
  cuda::Event filled(0);
  filled.record(cuda::current_stream(0));
  filled.block(side.stream());
  Tensor out = Tensor::empty({1 << 20}, DType::Float32, Device::cuda(0));
  {
    cuda::StreamGuard guard(side.stream());
    CHECK(cuda::current_stream(0) == side.stream());
    out.copy_(t);
    record_stream(t, 0, side.stream().handle());
  }
  CHECK(cuda::current_stream(0).handle() == nullptr);
  side.stream().synchronize();
  CHECK(out.to_vector<float>() == std::vector<float>(1 << 20, 3.f));
}

// Note [Not-ready queries] (tensor/cuda/cuda_check.h): a query that finds work still
// running must not leave cudaErrorNotReady behind for the next launch's check. The gate
// keeps the work running for as long as the test needs, on every GPU.
TEST_CASE("an event or block still pending leaves no error behind for the next kernel") {
  require_gpu();
  const Device gpu = Device::cuda(0);
  cuda::OwnedStream side(0);
  testing::StreamGate gate(side.stream().handle());

  cuda::Event pending(0);
  pending.record(side.stream());
  CHECK_FALSE(pending.completed());
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  Tensor t = Tensor::empty({4096}, DType::Float32, gpu);
  CHECK_NOTHROW(t.fill_(1.f));  // a kernel launch on the default stream, checked

  // The allocator polls the event of a block still used on the gated stream.
  {
    Tensor used = Tensor::empty({1 << 16}, DType::Float32, gpu);
    record_stream(used, 0, side.stream().handle());
  }
  Tensor again = Tensor::empty({1 << 16}, DType::Float32, gpu);  // must not take that block
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  CHECK_NOTHROW(again.fill_(2.f));
  CHECK(again.to_vector<float>() == std::vector<float>(1 << 16, 2.f));

  gate.open();
  pending.synchronize();
  CHECK(pending.completed());
  CHECK_FALSE(gate.timed_out());
  CHECK(t.to_vector<float>() == std::vector<float>(4096, 1.f));
}

TEST_CASE("an OwnedStream that ends hands its stream to the next one; blocks freed later find it alive") {
  // Note [Streams outlive their blocks] (tensor/cuda/stream.cpp).
  require_gpu();
  cudaStream_t first = nullptr;
  Tensor outlives;
  {
    cuda::OwnedStream a(0);
    first = a.stream().handle();
    cuda::StreamGuard guard(a.stream());
    outlives = Tensor::empty({1 << 16}, DType::Float32, Device::cuda(0));  // filed under a's stream
    outlives.fill_(1.f);
  }
  CHECK(cudaStreamQuery(first) == cudaSuccess);  // still a stream, with its work done
  outlives = Tensor();  // records its free on that stream: defined, since it lives
  cuda::OwnedStream b(0);
  CHECK(b.stream().handle() == first);
  cuda::OwnedStream c(0);
  CHECK(c.stream().handle() != first);
}

TEST_CASE("a device that does not exist is a clear error") {
  require_gpu();
  const int missing = cuda_info().device_count;
  CHECK_THROWS_WITH(Tensor::empty({4}, DType::Float32, Device::cuda(missing)),
                    Catch::Contains("does not exist"));
}

#else

TEST_CASE("builds without CUDA explain that GPU tensors need CUDA") {
  CHECK_THROWS_WITH(Tensor::empty({4}, DType::Float32, Device::cuda(0)),
                    Catch::Contains("needs a build with CUDA"));
  CHECK_THROWS_WITH(Tensor::empty_pinned({4}), Catch::Contains("needs a build with CUDA"));
}

#endif
