// gpu-labelled plumbing test: runs a CUDA kernel when a GPU exists, skips otherwise.
#include <catch2/catch.hpp>

#include <chrono>
#include <thread>
#include <vector>

#include "tensor/cuda_devices.h"
#include "tests/support/skip.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/fill.h"
#include "tensor/cuda/stream.h"
#include "tests/support/stream_gate.h"
#endif

TEST_CASE("CUDA fill kernel round-trips through device memory") {
  const auto& info = mtrain::cuda_info();
  if (info.device_count == 0) mtrain::testing::skip_test_binary(mtrain::cuda_summary().c_str());
#ifdef MTRAIN_HAVE_CUDA
  const int64_t n = 1000;
  float* d = nullptr;
  MTRAIN_CUDA_CHECK(cudaMalloc(&d, n * sizeof(float)));
  mtrain::cuda::fill(d, 2.5f, n);
  std::vector<float> h(n, 0.f);
  MTRAIN_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  MTRAIN_CUDA_CHECK(cudaFree(d));
  for (float v : h) REQUIRE(v == 2.5f);
#endif
}

TEST_CASE("cuda_info is consistent") {
  const auto& info = mtrain::cuda_info();
  if (info.device_count == 0) mtrain::testing::skip_test_binary(mtrain::cuda_summary().c_str());
  CHECK(info.device_names.size() == static_cast<size_t>(info.device_count));
}

TEST_CASE("GpuStopwatch reads the stream's time between its marks without blocking the host") {
  // --balance times each rank's forward and backward this way (trainer/loop/compute_timer.cpp).
  const auto& info = mtrain::cuda_info();
  if (info.device_count == 0) mtrain::testing::skip_test_binary(mtrain::cuda_summary().c_str());
#ifdef MTRAIN_HAVE_CUDA
  using Clock = std::chrono::steady_clock;
  mtrain::set_current_device(0);
  mtrain::GpuStopwatch watch(0);
  CHECK_FALSE(watch.seconds().has_value());  // never stopped
  const cudaStream_t stream = mtrain::cuda::current_stream(0).handle();
  watch.start();
  mtrain::testing::StreamGate gate(stream);  // the stream stalls between the marks
  watch.stop();
  const auto asked = Clock::now();
  CHECK_FALSE(watch.seconds().has_value());  // not passed yet, and the host did not wait
  CHECK(Clock::now() - asked < std::chrono::milliseconds(20));
  // The not-ready answer left no error behind for the next launch (Note [Not-ready queries]).
  float* d = nullptr;
  MTRAIN_CUDA_CHECK(cudaMalloc(&d, 16 * sizeof(float)));
  mtrain::cuda::fill(d, 1.0f, 16);
  CHECK(cudaGetLastError() == cudaSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  gate.open();
  std::optional<double> seconds;
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!(seconds = watch.seconds()) && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(seconds.has_value());
  CHECK(*seconds >= 0.055);  // the gate held the stream for at least the sleep
  CHECK(*seconds < 10.0);
  CHECK_FALSE(gate.timed_out());
  MTRAIN_CUDA_CHECK(cudaFree(d));
#endif
}
