// Convolutions through cuDNN's graph API (cudnn_graph.h).
//
// Note [Convolutions on the graph API]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cuDNN 9 runs a convolution two ways. The legacy API (cudnn_conv.cpp) picks an algorithm
// from a fixed list of eight or so, ranked by cudnnGet*Algorithm_v7. The graph API
// describes the call as a graph of tensor descriptors and one operation, asks cuDNN's
// heuristics (mode A, the mode PyTorch's cudnn-frontend path asks) to rank the engines
// that can run that graph, and runs an execution plan built for one of them; engines
// beyond the legacy list (newer tensor-core kernels among them) are reachable this way
// only. Which of the two is faster on a given GPU is measured, not assumed:
// NumericsOptions::cudnn_graph_api (MTRAIN_SPEEDUPS=cudnn-graph) turns this path on.
//
// Per call key (direction, data type, device, the calling thread's handle, numerics,
// shapes, beta: beta is part of the operation) the search runs once and its plans live
// for the process. The engines kept are those the numerics allow: for float32 data none
// that converts its inputs to 16 bits, and none on tensor cores (TF32) unless allow_tf32;
// with deterministic none noted nondeterministic; and none whose workspace exceeds what
// the device can give. Heuristics order decides, or with cudnn_benchmark the median of
// three timed runs of each of the first kCandidates plans. A plan that refuses its call
// (a NOT_SUPPORTED status, before anything is queued) gives way to the next, and the
// entry remembers it, as the legacy plans do. When no engine can run a shape, or cuDNN
// rejects its graph, the shape stays with the legacy API, said once in the log.
#include "tensor/cuda/cudnn_graph.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/library_handles.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_memory.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda {
namespace {

using Direction = GraphConvolution::Direction;

// Plans kept (and timed, with cudnn_benchmark) per shape.
constexpr size_t kCandidates = 8;

std::atomic<int64_t> g_runs{0};

// A cuDNN call made while building or planning a graph failed.
class GraphError : public Error {
 public:
  using Error::Error;
};

// One backend descriptor, destroyed with its owner.
class Backend {
 public:
  Backend(cudnnBackendDescriptorType_t type, const char* what) : what_(what) {
    check(cudnnBackendCreateDescriptor(type, &desc_), "creating");
  }
  ~Backend() {
    if (desc_ != nullptr) cudnnBackendDestroyDescriptor(desc_);
  }
  Backend(Backend&& other) noexcept : desc_(std::exchange(other.desc_, nullptr)), what_(other.what_) {}
  Backend& operator=(Backend&&) = delete;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  template <class T>
  Backend& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values,
               int64_t count = 1) {
    check(cudnnBackendSetAttribute(desc_, name, type, count, values),
          fmt::format("setting attribute {} of", static_cast<int>(name)));
    return *this;
  }
  // A descriptor-valued attribute.
  Backend& set(cudnnBackendAttributeName_t name, const Backend& value) {
    cudnnBackendDescriptor_t d = value.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &d);
  }
  void finalize() { check(cudnnBackendFinalize(desc_), "finalizing"); }
  cudnnBackendDescriptor_t get() const { return desc_; }

 private:
  void check(cudnnStatus_t status, const std::string& doing) const {
    if (status != CUDNN_STATUS_SUCCESS) {
      throw GraphError(fmt::format("{} the {} descriptor: {}", doing, what_, cudnn_error_text(status)));
    }
  }

  cudnnBackendDescriptor_t desc_ = nullptr;
  const char* what_;
};

// Ties a graph or a plan to the handle's device. cuDNN 9's headers mark both handle
// attributes deprecated, with nothing yet to replace them for a plan built at run time,
// so their names are spelled where the warning is silenced.
void set_handle(Backend& d, cudnnBackendAttributeName_t name, cudnnHandle_t handle) {
  d.set(name, CUDNN_TYPE_HANDLE, &handle);
}

// The tensors' unique ids: x (dx), w (dw), y (dy).
enum : int64_t { kX = 1, kW = 2, kY = 3 };

// A 4-d operand with logical dimensions [N, C, H, W], laid out NCHW or channels last.
Backend tensor(int64_t uid, cudnnDataType_t data, const std::array<int64_t, 4>& dims, bool channels_last) {
  const std::array<int64_t, 4> strides =
      channels_last ? std::array<int64_t, 4>{dims[1] * dims[2] * dims[3], 1, dims[3] * dims[1], dims[1]}
                    : std::array<int64_t, 4>{dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1};
  // Every operand starts on 16 bytes at least (gradients are views at 64-byte offsets).
  const int64_t alignment = 16;
  Backend t(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &data)
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4)
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4)
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid)
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment);
  t.finalize();
  return t;
}

Backend convolution(const GraphConvolution& c) {
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;  // what PyTorch calls convolution
  const int64_t spatial = 2;
  const std::array<int64_t, 2> dilations = {1, 1}, strides = {c.stride_h, c.stride_w},
                               padding = {c.pad_h, c.pad_w};
  Backend d(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, "convolution");
  d.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &compute)
      .set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, &mode)
      .set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, &spatial)
      .set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, dilations.data(), 2)
      .set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, strides.data(), 2)
      .set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, padding.data(), 2)
      .set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, padding.data(), 2);
  d.finalize();
  return d;
}

// The operation and every descriptor it refers to, kept together.
struct Operation {
  Backend x, w, y, conv, op;
};

Operation operation(const GraphConvolution& c) {
  Operation o{tensor(kX, c.data, {c.n, c.c, c.h, c.w}, c.channels_last),
              tensor(kW, c.data, {c.o, c.c, c.kh, c.kw}, c.channels_last),
              tensor(kY, c.data, {c.n, c.o, c.oh, c.ow}, c.channels_last), convolution(c),
              Backend(c.direction == Direction::Forward        ? CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR
                      : c.direction == Direction::BackwardData ? CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR
                                                               : CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
                      "convolution operation")};
  const float alpha = 1.0f, beta = c.beta;
  switch (c.direction) {
    case Direction::Forward:
      o.op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, o.x)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, o.w)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, o.y)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, o.conv)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, &alpha)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, &beta);
      break;
    case Direction::BackwardData:
      o.op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, o.x)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, o.w)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, o.y)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, o.conv)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_TYPE_FLOAT, &alpha)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, CUDNN_TYPE_FLOAT, &beta);
      break;
    case Direction::BackwardWeights:
      o.op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, o.x)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, o.w)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, o.y)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, o.conv)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_TYPE_FLOAT, &alpha)
          .set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, CUDNN_TYPE_FLOAT, &beta);
      break;
  }
  o.op.finalize();
  return o;
}

// The uids in the order of the data pointers run() passes, (in0, in1, out) by direction.
std::array<int64_t, 3> operand_uids(Direction d) {
  switch (d) {
    case Direction::Forward: return {kX, kW, kY};
    case Direction::BackwardData: return {kW, kY, kX};
    case Direction::BackwardWeights: return {kX, kY, kW};
  }
  return {kX, kW, kY};
}

// ---- plans --------------------------------------------------------------------------

// A usable plan, with the engine configuration it was built from (kept alive with it, as
// cudnn-frontend keeps what a finalized descriptor refers to).
struct Candidate {
  Backend config;
  Backend plan;
  int64_t workspace_bytes;
};

struct GraphPlan {
  std::unique_ptr<Operation> operation;
  std::unique_ptr<Backend> graph;
  std::vector<Candidate> candidates;  // best first; empty: the legacy API runs this shape
  std::atomic<size_t> first_candidate{0};  // moves past plans that refused their call
};

struct GraphKey {
  Direction direction;
  cudnnDataType_t data;
  int device;
  cudnnHandle_t handle;
  bool benchmark, deterministic, allow_tf32, channels_last;
  float beta;
  std::array<int64_t, 13> dims;
  bool operator==(const GraphKey& k) const {
    return direction == k.direction && data == k.data && device == k.device && handle == k.handle &&
           benchmark == k.benchmark && deterministic == k.deterministic && allow_tf32 == k.allow_tf32 &&
           channels_last == k.channels_last &&
           std::memcmp(&beta, &k.beta, sizeof beta) == 0 && dims == k.dims;
  }
};

struct GraphKeyHash {
  size_t operator()(const GraphKey& k) const {
    size_t h = static_cast<size_t>(k.direction) * 31 + static_cast<size_t>(k.data);
    h = h * 1000003u ^ (static_cast<size_t>(k.device) * 8 + k.benchmark * 4 + k.deterministic * 2 + k.allow_tf32);
    h = h * 1000003u ^ reinterpret_cast<uintptr_t>(k.handle);
    h = h * 1000003u ^ (static_cast<size_t>(k.beta != 0.0f) * 2 + k.channels_last);
    for (int64_t d : k.dims) h = h * 1000003u ^ static_cast<size_t>(d);
    return h;
  }
};

// Whether an engine's numerical notes fit the numerics settings for this data type.
bool allowed(const Backend& config, const GraphKey& key) {
  Backend engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
  cudnnBackendDescriptor_t e = engine.get();
  int64_t got = 0;
  if (cudnnBackendGetAttribute(config.get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got,
                               &e) != CUDNN_STATUS_SUCCESS) {
    return false;
  }
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               static_cast<int64_t>(notes.size()), &count, notes.data()) != CUDNN_STATUS_SUCCESS) {
    return false;
  }
  const bool float32 = key.data == CUDNN_DATA_FLOAT;
  for (int64_t i = 0; i < count; ++i) {
    switch (notes[static_cast<size_t>(i)]) {
      case CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS:
        if (float32) return false;
        break;
      case CUDNN_NUMERICAL_NOTE_TENSOR_CORE:
        if (float32 && !key.allow_tf32) return false;
        break;
      case CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC:
        if (key.deterministic) return false;
        break;
      default:
        break;
    }
  }
  return true;
}

// The heuristics' engine configurations for `graph`, best first.
std::vector<Backend> rated_configurations(const Backend& graph) {
  Backend heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heuristics.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
  heuristics.finalize();
  int64_t count = 0;
  cudnnStatus_t status = cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
  if (status != CUDNN_STATUS_SUCCESS) {
    throw GraphError(fmt::format("counting the heuristics' engines: {}", cudnn_error_text(status)));
  }
  std::vector<Backend> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration");
    raw.push_back(configs.back().get());
  }
  status = cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count, raw.data());
  if (status != CUDNN_STATUS_SUCCESS) {
    throw GraphError(fmt::format("reading the heuristics' engines: {}", cudnn_error_text(status)));
  }
  while (static_cast<int64_t>(configs.size()) > std::max<int64_t>(count, 0)) configs.pop_back();
  return configs;
}

// The execution plan of `config`, or nothing when cuDNN cannot build it for this graph or
// its workspace is larger than `limit`.
std::optional<Candidate> plan_of(cudnnHandle_t handle, Backend&& config, size_t limit) {
  Backend plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  set_handle(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle);
#pragma GCC diagnostic pop
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config);
  if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS) return std::nullopt;
  int64_t bytes = 0, got = 0;
  if (cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got,
                               &bytes) != CUDNN_STATUS_SUCCESS ||
      bytes < 0 || static_cast<size_t>(bytes) > limit) {
    return std::nullopt;
  }
  return Candidate{std::move(config), std::move(plan), bytes};
}

// Queues one run of `c` with the operands in run()'s order; returns cuDNN's status.
cudnnStatus_t execute(cudnnHandle_t handle, int device, const Candidate& c, Direction direction,
                      const std::array<const void*, 3>& operands) {
  Tensor ws = workspace(device, static_cast<size_t>(c.workspace_bytes));
  Backend pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
  const std::array<int64_t, 3> uids = operand_uids(direction);
  std::array<void*, 3> pointers{};
  for (size_t i = 0; i < 3; ++i) pointers[i] = const_cast<void*>(operands[i]);
  void* ws_pointer = ws.defined() ? ws.raw_data() : nullptr;
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), 3)
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, pointers.data(), 3)
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &ws_pointer);
  pack.finalize();
  // `ws` goes back to the allocator after the call is queued (workspace() in
  // library_handles.h).
  return cudnnBackendExecute(handle, c.plan.get(), pack.get());
}

// Median milliseconds of three runs of each candidate into a scratch output of `out_bytes`
// (the real output may accumulate); reorders them fastest first.
void time_candidates(cudnnHandle_t handle, int device, GraphPlan& plan, Direction direction, const void* in0,
                     const void* in1, size_t out_bytes) {
  Tensor scratch = workspace(device, out_bytes);
  const cudaStream_t stream = current_stream(device).handle();
  cudaEvent_t start = nullptr, stop = nullptr;
  MTRAIN_CUDA_CHECK(cudaEventCreate(&start));
  MTRAIN_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<std::pair<float, size_t>> timed;
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    std::array<float, 3> ms{};
    bool ran = true;
    for (float& t : ms) {
      MTRAIN_CUDA_CHECK(cudaEventRecord(start, stream));
      ran = execute(handle, device, plan.candidates[i], direction, {in0, in1, scratch.raw_data()}) ==
            CUDNN_STATUS_SUCCESS;
      MTRAIN_CUDA_CHECK(cudaEventRecord(stop, stream));
      MTRAIN_CUDA_CHECK(cudaEventSynchronize(stop));
      MTRAIN_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      if (!ran) break;
    }
    std::sort(ms.begin(), ms.end());
    // A plan that refused to run goes last; run() skips it the first time it refuses again.
    timed.emplace_back(ran ? ms[1] : 1e30f, i);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::stable_sort(timed.begin(), timed.end());
  std::vector<Candidate> ordered;
  for (const auto& [ms, i] : timed) ordered.push_back(std::move(plan.candidates[i]));
  plan.candidates = std::move(ordered);
}

size_t element_bytes(cudnnDataType_t data) { return data == CUDNN_DATA_FLOAT ? 4 : 2; }

// The output's size in bytes, by direction.
size_t output_bytes(const GraphConvolution& c) {
  const int64_t elements = c.direction == Direction::Forward        ? c.n * c.o * c.oh * c.ow
                           : c.direction == Direction::BackwardData ? c.n * c.c * c.h * c.w
                                                                    : c.o * c.c * c.kh * c.kw;
  return static_cast<size_t>(elements) * element_bytes(c.data);
}

// Builds the graph and its usable plans; an error leaves `plan` without candidates and
// says why once.
void make_plan(GraphPlan& plan, const GraphKey& key, const GraphConvolution& conv, const void* in0,
               const void* in1, const std::string& context) {
  std::string reason;
  try {
    plan.operation = std::make_unique<Operation>(operation(conv));
    plan.graph = std::make_unique<Backend>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    plan.graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, plan.operation->op);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    set_handle(*plan.graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, key.handle);
#pragma GCC diagnostic pop
    plan.graph->finalize();
    const size_t limit = workspace_limit(key.device);
    int rated = 0, numerics_ruled_out = 0;
    for (Backend& config : rated_configurations(*plan.graph)) {
      ++rated;
      if (!allowed(config, key)) {
        ++numerics_ruled_out;
        continue;
      }
      if (std::optional<Candidate> c = plan_of(key.handle, std::move(config), limit)) {
        plan.candidates.push_back(std::move(*c));
      }
      if (plan.candidates.size() == kCandidates) break;
    }
    if (plan.candidates.empty()) {
      reason = fmt::format("none of the {} engines the heuristics rated can run it ({} ruled out by the numerics "
                           "settings, the rest refused or need more workspace than {} bytes)",
                           rated, numerics_ruled_out, limit);
    }
  } catch (const GraphError& e) {
    plan.candidates.clear();
    reason = e.what();
  }
  if (!reason.empty()) {
    spdlog::warn("cuDNN graph API, {}: {}; the legacy API runs this convolution", context, reason);
    return;
  }
  if (key.benchmark && plan.candidates.size() > 1) {
    time_candidates(key.handle, key.device, plan, conv.direction, in0, in1, output_bytes(conv));
    // As the legacy benchmark (Note [The trials' workspace goes back to the device] in
    // cudnn_conv.cpp).
    cuda_release_cached_memory(key.device);
  }
}

GraphPlan& cached_plan(const GraphKey& key, const GraphConvolution& conv, const void* in0, const void* in1,
                       const std::string& context) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<GraphKey, std::unique_ptr<GraphPlan>, GraphKeyHash>();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache->find(key); it != cache->end()) return *it->second;
  }
  auto plan = std::make_unique<GraphPlan>();
  make_plan(*plan, key, conv, in0, in1, context);
  std::lock_guard<std::mutex> lock(mu);
  return *cache->emplace(key, std::move(plan)).first->second;
}

}  // namespace

bool run_graph_convolution(int device, const GraphConvolution& conv, const void* in0, const void* in1, void* out,
                           const std::string& context) {
  const cuda_ops::NumericsOptions numerics = cuda_ops::numerics();
  cudnnHandle_t handle = cudnn_handle(device);
  const GraphKey key{conv.direction,
                     conv.data,
                     device,
                     handle,
                     numerics.cudnn_benchmark,
                     numerics.deterministic,
                     numerics.allow_tf32,
                     conv.channels_last,
                     conv.beta,
                     {conv.n, conv.c, conv.h, conv.w, conv.o, conv.kh, conv.kw, conv.oh, conv.ow, conv.stride_h,
                      conv.stride_w, conv.pad_h, conv.pad_w}};
  GraphPlan& plan = cached_plan(key, conv, in0, in1, context);
  if (plan.candidates.empty()) return false;
  std::string refused;
  for (size_t i = plan.first_candidate.load(std::memory_order_relaxed); i < plan.candidates.size(); ++i) {
    const cudnnStatus_t status = execute(handle, device, plan.candidates[i], conv.direction, {in0, in1, out});
    if (status == CUDNN_STATUS_SUCCESS) {
      size_t expected = plan.first_candidate.load(std::memory_order_relaxed);
      if (i > expected) plan.first_candidate.compare_exchange_strong(expected, i);
      g_runs.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    if (CUDNN_STATUS_CATEGORY(status) != CUDNN_STATUS_NOT_SUPPORTED) {
      throw_cudnn_error(status, "cudnnBackendExecute", context, __FILE__, __LINE__);
    }
    refused += fmt::format("; plan {}: {}", i, cudnn_error_text(status));
  }
  throw Error(fmt::format("{}: none of the {} cuDNN graph plans for this convolution could run{}", context,
                          plan.candidates.size(), refused));
}

int64_t graph_convolutions_run() { return g_runs.load(std::memory_order_relaxed); }

void check_graph_operation(const GraphConvolution& conv) { operation(conv); }

}  // namespace mtrain::cuda
