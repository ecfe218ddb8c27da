// gpu: GpuGraph (tensor/cuda_graph.h) on a real GPU: a capture records without running,
// each replay runs it again on the captured addresses, memory allocated in the capture
// stays the graph's, a GpuMark made in the capture is recorded by every replay, and a
// capture the runtime refuses says why and leaves the device usable. Skips the whole
// binary without a GPU.
#include <catch2/catch.hpp>

#include <optional>
#include <stdexcept>
#include <vector>

#include "core/error.h"
#include "tensor/cuda_devices.h"
#include "tensor/cuda_graph.h"
#include "tensor/host_copy.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"
#include "tests/support/skip.h"

using namespace mtrain;
using Catch::Matchers::Contains;

#ifdef MTRAIN_HAVE_CUDA

namespace {
void require_gpu() {
  if (cuda_info().device_count == 0) testing::skip_test_binary(cuda_summary().c_str());
}

std::vector<float> values(const Tensor& t) { return t.to(Device::cpu()).to_vector<float>(); }
}  // namespace

TEST_CASE("a capture records without running; each replay runs it on the captured addresses") {
  require_gpu();
  const Device gpu = Device::cuda(0);
  Tensor x = Tensor::from_vector<float>({1, 2, 3, 4}, {4}).to(gpu);
  std::optional<HostCopy> seen;  // its mark is a node of the graph: it outlives the graph
  GpuGraph graph(0);
  CHECK_FALSE(graph.captured());
  const void* scratch = nullptr;
  const std::string failure = graph.capture([&] {
    Tensor t = Tensor::empty({4}, DType::Float32, gpu);  // the graph's own memory
    scratch = t.raw_data();
    t.copy_(x);
    ops::scale_(t, 2.0f);
    x.copy_(t);
    seen.emplace(x);  // a copy to pinned memory and a mark, both in the graph
  });
  REQUIRE(failure.empty());
  CHECK(graph.captured());
  CHECK(graph.nodes() >= 4);
  CHECK(values(x) == std::vector<float>{1, 2, 3, 4});  // nothing ran

  // Memory freed inside the capture is the graph's: no tensor made outside gets it.
  std::vector<Tensor> others;
  for (int i = 0; i < 8; ++i) {
    others.push_back(Tensor::empty({4}, DType::Float32, gpu));
    CHECK(others.back().raw_data() != scratch);
  }

  graph.replay();
  CHECK(seen->wait().to_vector<float>() == std::vector<float>{2, 4, 6, 8});
  graph.replay();
  graph.replay();
  CHECK(seen->wait().to_vector<float>() == std::vector<float>{8, 16, 24, 32});
  CHECK(values(x) == std::vector<float>{8, 16, 24, 32});
  CHECK_THROWS_AS(graph.capture([] {}), InternalError);
}

TEST_CASE("a capture that fails says why, runs nothing and leaves the device usable") {
  require_gpu();
  const Device gpu = Device::cuda(0);
  Tensor x = Tensor::from_vector<float>({1, 2}, {2}).to(gpu);
  {
    GpuGraph graph(0);
    // Reading the GPU on the host inside a capture: the runtime refuses the wait.
    const std::string failure = graph.capture([&] {
      ops::scale_(x, 3.0f);
      (void)x.to(Device::cpu());
    });
    INFO(failure);
    CHECK_FALSE(failure.empty());
    CHECK_FALSE(graph.captured());
    CHECK_THROWS_AS(graph.replay(), InternalError);
  }
  {
    GpuGraph graph(0);
    const std::string failure = graph.capture([&] {
      ops::scale_(x, 3.0f);
      throw InvalidArgument("the work's own error");
    });
    CHECK_THAT(failure, Contains("the work's own error"));
    CHECK_FALSE(graph.captured());
  }
  CHECK(values(x) == std::vector<float>{1, 2});  // neither scale ran
  ops::scale_(x, 3.0f);
  CHECK(values(x) == std::vector<float>{3, 6});
}

#else

TEST_CASE("a build without CUDA refuses a GPU graph") {
  CHECK_THROWS_AS(GpuGraph(0), InvalidArgument);
}

#endif
