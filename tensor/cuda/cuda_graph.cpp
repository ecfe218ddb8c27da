// The CUDA side of GpuGraph (Note [Captured steps] in tensor/cuda_graph.h).
#include "tensor/cuda_graph.h"

#include <fmt/format.h>

#include <exception>

#include "core/error.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_hooks.h"

namespace mtrain {

struct GpuGraph::State {
  explicit State(int d) : device(d), stream(d) {}
  int device;
  cuda::OwnedStream stream;  // where the capture runs; its blocks are the graph's
  cudaGraphExec_t exec = nullptr;
  size_t nodes = 0;
};

GpuGraph::GpuGraph(int device) : state_(std::make_unique<State>(device)) {
  detail::set_private_stream(device, state_->stream.stream().handle(), true);
}

GpuGraph::~GpuGraph() {
  const int device = state_->device;
  const cudaStream_t handle = state_->stream.stream().handle();
  if (state_->exec != nullptr) {
    // The replays ran on their callers' streams: wait for all of them before the memory
    // they use becomes anybody's.
    cuda::DeviceGuard guard(device);
    cudaDeviceSynchronize();
    cudaGraphExecDestroy(state_->exec);
  }
  try {
    detail::set_private_stream(device, handle, false);
  } catch (const std::exception&) {
    // The blocks stay private: unused memory, not wrong results.
  }
}

std::string GpuGraph::capture(const std::function<void()>& work) {
  MTRAIN_CHECK(state_->exec == nullptr, "GpuGraph::capture of a graph already captured");
  const cuda::Stream stream = state_->stream.stream();
  cuda::DeviceGuard device(state_->device);
  std::string failure;
  cudaGraph_t graph = nullptr;
  {
    const cuda::StreamGuard on_graph_stream(stream);
    MTRAIN_CUDA_CHECK(cudaStreamBeginCapture(stream.handle(), cudaStreamCaptureModeRelaxed));
    try {
      work();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    const cudaError_t ended = cudaStreamEndCapture(stream.handle(), &graph);
    if (ended != cudaSuccess && failure.empty()) {
      failure = fmt::format("the CUDA runtime ended the capture with {}", cudaGetErrorString(ended));
    }
  }
  if (failure.empty()) {
    const cudaError_t made = cudaGraphInstantiate(&state_->exec, graph, 0);
    if (made != cudaSuccess) {
      state_->exec = nullptr;
      failure = fmt::format("the CUDA runtime could not instantiate the graph: {}", cudaGetErrorString(made));
    } else {
      cudaGraphGetNodes(graph, nullptr, &state_->nodes);
    }
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!failure.empty()) cudaGetLastError();  // a refused call's error is not the next call's
  return failure;
}

void GpuGraph::replay() {
  MTRAIN_CHECK(state_->exec != nullptr, "GpuGraph::replay before a capture");
  cuda::DeviceGuard device(state_->device);
  MTRAIN_CUDA_CHECK(cudaGraphLaunch(state_->exec, cuda::current_stream(state_->device).handle()));
}

bool GpuGraph::captured() const { return state_->exec != nullptr; }

size_t GpuGraph::nodes() const { return state_->nodes; }

}  // namespace mtrain
