// gpu-labelled plumbing test: runs a CUDA kernel when a GPU exists, skips otherwise.
#include <catch2/catch.hpp>

#include <vector>

#include "tensor/cuda_runtime.h"
#include "tests/support/skip.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/kernels.h"
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
