// 2-D convolution on cuDNN (the GPU side of tensor/cpu/conv.cpp; Note [Kernel
// dispatch] in tensor/ops.cpp).
//
// Note [cuDNN convolution plans]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// This uses cuDNN's legacy convolution API (cudnnConvolutionForward,
// cudnnConvolutionBackwardData/Filter, cudnnGet*Algorithm_v7, cudnnFind*AlgorithmEx).
// cuDNN 9 marks it deprecated (CUDNN_DEPRECATED, a warning only with
// CUDNN_WARN_DEPRECATED) but ships it in libcudnn_cnn; checked against cuDNN 9.19's
// cudnn_cnn.h. It covers NCHW convolutions, float32 and the pseudo-16-bit
// configurations (Note [16-bit kernels on the GPU] in cuda_ops.h), with a few calls each,
// where the graph API would need an operation graph and engine configuration per shape.
//
// Choosing an algorithm costs more than running a small convolution (heuristics query
// the library; benchmark mode times every algorithm), and training repeats the same few
// shapes, so every (direction, device, shapes, stride, padding, numerics) key gets one
// plan, made on first use and kept for the life of the process: the descriptors and the
// usable algorithms, best first (Note [Convolution algorithm choice] in cuda_ops.h says
// what "best" means in each mode). An algorithm is usable when cuDNN reports it
// supported, it is deterministic if numerics().deterministic asks for that, its math type
// agrees with allow_tf32 (for float32 data; 16-bit plans search with tensor-op math and
// take whatever cuDNN rates), and its workspace fits workspace_limit() at planning time.
//
// The math type is a property of the convolution descriptor, and cuDNN reports per
// algorithm which math type it was rated with (with TF32 allowed it may offer both
// tensor-core and FMA variants). A plan is shared between threads, so it never changes
// a descriptor after planning: it keeps one convolution descriptor per math type its
// algorithms need. For float32 data cuDNN 9 reads CUDNN_DEFAULT_MATH as "tensor cores
// (TF32) permitted on Ampere and newer", CUDNN_TENSOR_OP_MATH as "tensor cores
// permitted", and CUDNN_FMA_MATH as "FMA kernels only, no TF32" (PyTorch's mapping of
// cudnn.allow_tf32). Algorithms rated CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION may convert
// float32 to half precision and are never used.
//
// Each call takes its workspace from the caching allocator (cuda::workspace). When that
// allocation fails even after the allocator returned its cache, or cuDNN refuses the
// algorithm (a NOT_SUPPORTED status, returned before anything is launched), the call
// falls back to the next algorithm of the plan, and the plan remembers the fallback so
// later calls do not fail the same way again (PyTorch's AlgoIterator does the same).
//
// The activations x, y, dy and dx may each be float32 or 16-bit (Note [16-bit activations]
// in tensor/ops.h); w, dw, b and db are float32. cuDNN always sees its operands and output
// in the compute type p.compute: an activation already of that type is passed as is, any
// other is converted into a temporary (detail::compute_operand), and an output not of that
// type is written to a scratch in the compute type and converted into it (finish_output).
// The bias and its gradient on 16-bit y and dy: with a float32 compute type the bias is
// added to the float32 scratch output by cuDNN and the sum rounded once into y; with a
// 16-bit one, by one pass over cuDNN's 16-bit output (detail::add_channel_bias), which
// rounds the result a second time, as autocast does. db sums the 16-bit dy itself in
// double (detail::channel_sums), deterministically; a float32 dy keeps
// cudnnConvolutionBackwardBias.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "tensor/caching_block_allocator.h"
#include "tensor/cuda/cudnn_graph.h"
#include "tensor/cuda/library_handles.h"
#include "tensor/cuda/mixed_precision.h"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_memory.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_ndim;
using detail::check_on;
using detail::check_on_shape;

enum class ConvDirection : uint8_t { Forward, BackwardData, BackwardWeights };

const char* op_name(ConvDirection d) {
  switch (d) {
    case ConvDirection::Forward: return "conv2d_forward";
    case ConvDirection::BackwardData: return "conv2d_backward_data";
    case ConvDirection::BackwardWeights: return "conv2d_backward_weights";
  }
  return "conv2d";
}

// Sizes of one convolution: x[n,c,h,w] * w[o,c/g,kh,kw] -> y[n,o,oh,ow], in g groups.
struct ConvShape {
  int64_t n, c, h, w, o, kh, kw, oh, ow;
  int64_t g = 1;
};

// One convolution call, described for error messages only when something fails.
struct ConvCall {
  ConvDirection direction;
  ConvShape s;
  ops::Conv2dParams p;

  std::string str() const {
    return fmt::format("running {} on cuDNN with x [{}, {}, {}, {}], w [{}, {}, {}, {}], "
                       "y [{}, {}, {}, {}], stride {}x{}, padding {}x{}{}{}",
                       op_name(direction), s.n, s.c, s.h, s.w, s.o, s.c / s.g, s.kh, s.kw, s.n, s.o,
                       s.oh, s.ow, p.stride_h, p.stride_w, p.pad_h, p.pad_w,
                       s.g == 1 ? "" : fmt::format(", {} groups", s.g), p.channels_last ? ", channels last" : "");
  }
};

// ---- descriptors (RAII; destroyed only on a failed planning, plans live forever) ----

template <class T, cudnnStatus_t (*Create)(T*), cudnnStatus_t (*Destroy)(T)>
class Descriptor {
 public:
  explicit Descriptor(const std::string& context) { MTRAIN_CUDNN_CHECK(Create(&desc_), context); }
  ~Descriptor() { Destroy(desc_); }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  T get() const { return desc_; }

 private:
  T desc_ = nullptr;
};

using TensorDesc = Descriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor,
                              cudnnDestroyTensorDescriptor>;
using FilterDesc = Descriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor,
                              cudnnDestroyFilterDescriptor>;
using ConvDesc = Descriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                            cudnnDestroyConvolutionDescriptor>;

std::unique_ptr<ConvDesc> make_conv_desc(const ops::Conv2dParams& p, cudnnMathType_t math,
                                         const std::string& context) {
  auto desc = std::make_unique<ConvDesc>(context);
  // Cross-correlation (no kernel flip) is what PyTorch and oneDNN call convolution.
  MTRAIN_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(desc->get(), p.pad_h, p.pad_w, p.stride_h,
                                                     p.stride_w, p.dilation_h, p.dilation_w,
                                                     CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
                     context);
  MTRAIN_CUDNN_CHECK(cudnnSetConvolutionMathType(desc->get(), math), context);
  MTRAIN_CUDNN_CHECK(cudnnSetConvolutionGroupCount(desc->get(), p.groups), context);
  return desc;
}

// ---- plans ----------------------------------------------------------------------------

struct Candidate {
  int algo = 0;  // the direction's cudnnConvolution*Algo_t
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspace_bytes = 0;
};

constexpr size_t kMathTypes = 4;  // cudnnMathType_t has values 0..3

struct ConvPlan {
  explicit ConvPlan(const std::string& context) : x(context), y(context), w(context) {}

  // x [n,c,h,w], y [n,o,oh,ow] and w in the compute type.
  TensorDesc x, y;
  FilterDesc w;           // [o,c,kh,kw]
  std::array<std::unique_ptr<ConvDesc>, kMathTypes> conv;  // by math type
  std::vector<Candidate> candidates;                        // best first, never empty
  std::atomic<size_t> first_candidate{0};  // moves past algorithms that could not run
  // cuDNN promises thread safety for calls on distinct handles but says nothing about
  // sharing descriptors between threads at once (cuDNN 9 builds engine plans behind the
  // legacy API), so the calls using a plan's descriptors are serialised. The lock is
  // held only while work is queued, and one training thread per GPU never contends.
  std::mutex mu;

  cudnnConvolutionDescriptor_t conv_for(cudnnMathType_t math) const {
    return conv[static_cast<size_t>(math)]->get();
  }
};

struct ConvKey {
  ConvDirection direction;
  DType compute;
  int device;
  bool benchmark, deterministic, allow_tf32, channels_last;
  std::array<int64_t, 16> dims;
  bool operator==(const ConvKey&) const = default;
};

struct ConvKeyHash {
  size_t operator()(const ConvKey& k) const {
    size_t h = (static_cast<size_t>(k.direction) * 8 + static_cast<size_t>(k.compute)) * 16 +
               k.benchmark * 8 + k.deterministic * 4 + k.allow_tf32 * 2 + k.channels_last;
    h = h * 1000003u ^ static_cast<size_t>(k.device);
    for (int64_t d : k.dims) h = h * 1000003u ^ static_cast<size_t>(d);
    return h;
  }
};

// What the benchmark (cudnnFind*Ex) runs on: the real inputs, and a scratch output of
// `out_shape` that it allocates, so that no output (an accumulated gradient above all)
// is overwritten by trial runs.
struct FindBuffers {
  const void* in0;  // x (forward, weights) or w (data)
  const void* in1;  // w (forward) or dy (data, weights)
  Shape out_shape;  // of y, dx or dw
  DType out_dtype;  // the compute type
};

// The three directions differ only in which cuDNN functions they call and in argument
// order; each traits struct maps the shared planning code onto its functions.
struct ForwardCalls {
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  using Algo = cudnnConvolutionFwdAlgo_t;
  static constexpr int kAlgoCount = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  static cudnnStatus_t max_count(cudnnHandle_t h, int* n) {
    return cudnnGetConvolutionForwardAlgorithmMaxCount(h, n);
  }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const ConvPlan& p,
                                  cudnnConvolutionDescriptor_t c, int n, int* got, Perf* perf) {
    return cudnnGetConvolutionForwardAlgorithm_v7(h, p.x.get(), p.w.get(), c, p.y.get(), n, got,
                                                  perf);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const ConvPlan& p, cudnnConvolutionDescriptor_t c,
                            const void* in0, const void* in1, void* out, int n, int* got,
                            Perf* perf, void* ws, size_t ws_bytes) {
    return cudnnFindConvolutionForwardAlgorithmEx(h, p.x.get(), in0, p.w.get(), in1, c,
                                                  p.y.get(), out, n, got, perf, ws, ws_bytes);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, const ConvPlan& p,
                                 cudnnConvolutionDescriptor_t c, int algo, size_t* bytes) {
    return cudnnGetConvolutionForwardWorkspaceSize(h, p.x.get(), p.w.get(), c, p.y.get(),
                                                   static_cast<Algo>(algo), bytes);
  }
};

struct BackwardDataCalls {
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  using Algo = cudnnConvolutionBwdDataAlgo_t;
  static constexpr int kAlgoCount = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  static cudnnStatus_t max_count(cudnnHandle_t h, int* n) {
    return cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, n);
  }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const ConvPlan& p,
                                  cudnnConvolutionDescriptor_t c, int n, int* got, Perf* perf) {
    return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p.w.get(), p.y.get(), c, p.x.get(), n,
                                                       got, perf);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const ConvPlan& p, cudnnConvolutionDescriptor_t c,
                            const void* in0, const void* in1, void* out, int n, int* got,
                            Perf* perf, void* ws, size_t ws_bytes) {
    return cudnnFindConvolutionBackwardDataAlgorithmEx(h, p.w.get(), in0, p.y.get(), in1, c,
                                                       p.x.get(), out, n, got, perf, ws,
                                                       ws_bytes);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, const ConvPlan& p,
                                 cudnnConvolutionDescriptor_t c, int algo, size_t* bytes) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w.get(), p.y.get(), c, p.x.get(),
                                                        static_cast<Algo>(algo), bytes);
  }
};

struct BackwardWeightsCalls {
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  using Algo = cudnnConvolutionBwdFilterAlgo_t;
  static constexpr int kAlgoCount = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  static cudnnStatus_t max_count(cudnnHandle_t h, int* n) {
    return cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, n);
  }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const ConvPlan& p,
                                  cudnnConvolutionDescriptor_t c, int n, int* got, Perf* perf) {
    return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p.x.get(), p.y.get(), c, p.w.get(),
                                                         n, got, perf);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const ConvPlan& p, cudnnConvolutionDescriptor_t c,
                            const void* in0, const void* in1, void* out, int n, int* got,
                            Perf* perf, void* ws, size_t ws_bytes) {
    return cudnnFindConvolutionBackwardFilterAlgorithmEx(h, p.x.get(), in0, p.y.get(), in1,
                                                         c, p.w.get(), out, n, got, perf, ws,
                                                         ws_bytes);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, const ConvPlan& p,
                                 cudnnConvolutionDescriptor_t c, int algo, size_t* bytes) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p.x.get(), p.y.get(), c, p.w.get(),
                                                          static_cast<Algo>(algo), bytes);
  }
};

// The largest workspace the benchmark may hand cudnnFind*Ex: the biggest any algorithm
// wants that can actually be allocated (trying the sizes largest first), so that every
// algorithm that fits gets timed.
template <class Calls>
Tensor find_workspace(int device, cudnnHandle_t handle, const ConvPlan& plan,
                      cudnnConvolutionDescriptor_t conv, size_t limit) {
  std::vector<size_t> sizes;
  for (int algo = 0; algo < Calls::kAlgoCount; ++algo) {
    size_t bytes = 0;
    // An algorithm that does not support this convolution reports an error: skip it.
    if (Calls::workspace(handle, plan, conv, algo, &bytes) == CUDNN_STATUS_SUCCESS &&
        bytes > 0 && bytes <= limit) {
      sizes.push_back(bytes);
    }
  }
  std::sort(sizes.rbegin(), sizes.rend());
  for (size_t bytes : sizes) {
    try {
      return cuda::workspace(device, bytes);
    } catch (const OutOfMemoryError&) {
      // Time only the algorithms that need less. Any other failure (a sticky error
      // from an earlier kernel, say) is not the algorithm's and propagates.
    }
  }
  return Tensor();
}

template <class Calls>
void plan_algorithms(ConvPlan& plan, int device, const ConvKey& key, const ConvShape& s,
                     const ops::Conv2dParams& params, const FindBuffers& buffers,
                     const std::string& context) {
  cudnnHandle_t handle = cuda::cudnn_handle(device);
  // 16-bit data is what tensor cores are for: TF32 settings concern float32 only.
  const bool float32 = key.compute == DType::Float32;
  const cudnnMathType_t search_math =
      !float32 ? CUDNN_TENSOR_OP_MATH : key.allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
  plan.conv[static_cast<size_t>(search_math)] = make_conv_desc(params, search_math, context);
  const cudnnConvolutionDescriptor_t search_conv = plan.conv_for(search_math);

  // cuDNN must size the output as mtrain does (ops::conv_out_size, PyTorch's rule).
  int n = 0, o = 0, oh = 0, ow = 0;
  MTRAIN_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(search_conv, plan.x.get(),
                                                           plan.w.get(), &n, &o, &oh, &ow),
                     context);
  MTRAIN_CHECK(n == s.n && o == s.o && oh == s.oh && ow == s.ow,
               "{}: cuDNN sizes the output [{}, {}, {}, {}], mtrain [{}, {}, {}, {}]", context, n,
               o, oh, ow, s.n, s.o, s.oh, s.ow);

  const size_t limit = cuda::workspace_limit(device);

  int max_count = 0;
  MTRAIN_CUDNN_CHECK(Calls::max_count(handle, &max_count), context);
  std::vector<typename Calls::Perf> perfs(static_cast<size_t>(std::max(max_count, 1)));
  int returned = 0;
  if (key.benchmark) {
    {
      Tensor scratch_out = Tensor::empty(buffers.out_shape, buffers.out_dtype, Device::cuda(device));
      Tensor ws = find_workspace<Calls>(device, handle, plan, search_conv, limit);
      MTRAIN_CUDNN_CHECK(Calls::find(handle, plan, search_conv, buffers.in0, buffers.in1,
                                     scratch_out.raw_data(), max_count, &returned, perfs.data(),
                                     ws.defined() ? ws.raw_data() : nullptr,
                                     ws.defined() ? ws.nbytes() : 0),
                         context);
    }
    // Note [The trials' workspace goes back to the device]: the trials take the largest
    // workspace any algorithm asks for, up to all free memory, and the caching allocator
    // never splits a block, so that block would stay reserved and unused for the rest of
    // the run (an H200 held 14.5 GB after 30 resnet18 steps with --cudnn-benchmark,
    // 1.9 GB without). Planning happens once per shape, so returning the cache to the
    // device here costs a few synchronisations at the start of a run.
    cuda_release_cached_memory(device);
  } else {
    MTRAIN_CUDNN_CHECK(
        Calls::heuristics(handle, plan, search_conv, max_count, &returned, perfs.data()),
        context);
  }

  int rejected_nondeterministic = 0;
  for (int i = 0; i < returned; ++i) {
    const auto& perf = perfs[static_cast<size_t>(i)];
    if (perf.status != CUDNN_STATUS_SUCCESS) continue;
    if (static_cast<size_t>(perf.mathType) >= kMathTypes) continue;  // unknown to this build
    if (perf.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (float32 && !key.allow_tf32 && perf.mathType != CUDNN_FMA_MATH) continue;
    if (key.deterministic && perf.determinism != CUDNN_DETERMINISTIC) {
      ++rejected_nondeterministic;
      continue;
    }
    auto& conv = plan.conv[static_cast<size_t>(perf.mathType)];
    if (!conv) conv = make_conv_desc(params, perf.mathType, context);
    // Asked again with the algorithm's own math type: that is the descriptor it runs with.
    // An algorithm whose size cannot be had is as unusable as one that does not fit.
    size_t bytes = 0;
    if (Calls::workspace(handle, plan, conv->get(), static_cast<int>(perf.algo), &bytes) !=
            CUDNN_STATUS_SUCCESS ||
        bytes > limit) {
      continue;
    }
    const int algo = static_cast<int>(perf.algo);
    const bool duplicate = std::any_of(
        plan.candidates.begin(), plan.candidates.end(),
        [&](const Candidate& c) { return c.algo == algo && c.math == perf.mathType; });
    if (!duplicate) plan.candidates.push_back({algo, perf.mathType, bytes});
  }
  if (plan.candidates.empty()) {
    if (rejected_nondeterministic > 0) {
      throw InvalidArgument(fmt::format(
          "{}: deterministic mode is on, but cuDNN has no deterministic algorithm for this "
          "convolution ({} nondeterministic ones offered); turn deterministic mode off",
          context, rejected_nondeterministic));
    }
    throw Error(fmt::format("{}: cuDNN offered no usable algorithm ({} rated, none supported "
                            "with {} within a workspace limit of {})",
                            context, returned,
                            !float32 ? dtype_name(key.compute)
                                     : key.allow_tf32 ? "TF32 allowed" : "FMA math only",
                            format_bytes(limit)));
  }
}

std::unique_ptr<ConvPlan> make_plan(const ConvKey& key, const ConvShape& s,
                                    const ops::Conv2dParams& p, const FindBuffers& buffers,
                                    const std::string& context) {
  auto plan = std::make_unique<ConvPlan>(context);
  const auto i = [](int64_t v) { return static_cast<int>(v); };  // sizes checked by conv_shape
  // The legacy API's PSEUDO_BFLOAT16 / PSEUDO_HALF configurations: x, w and y 16-bit,
  // the convolution descriptor (make_conv_desc) float32.
  const cudnnDataType_t data = key.compute == DType::BFloat16  ? CUDNN_DATA_BFLOAT16
                               : key.compute == DType::Float16 ? CUDNN_DATA_HALF
                                                               : CUDNN_DATA_FLOAT;
  // Channels last (Note [Channels last] in tensor/ops.h): x, y and the transposed w NHWC.
  const cudnnTensorFormat_t format = key.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  MTRAIN_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->x.get(), format, data,
                                                i(s.n), i(s.c), i(s.h), i(s.w)),
                     context);
  MTRAIN_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->y.get(), format, data,
                                                i(s.n), i(s.o), i(s.oh), i(s.ow)),
                     context);
  MTRAIN_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan->w.get(), data, format,
                                                i(s.o), i(s.c / s.g), i(s.kh), i(s.kw)),
                     context);
  switch (key.direction) {
    case ConvDirection::Forward:
      plan_algorithms<ForwardCalls>(*plan, key.device, key, s, p, buffers, context);
      break;
    case ConvDirection::BackwardData:
      plan_algorithms<BackwardDataCalls>(*plan, key.device, key, s, p, buffers, context);
      break;
    case ConvDirection::BackwardWeights:
      plan_algorithms<BackwardWeightsCalls>(*plan, key.device, key, s, p, buffers, context);
      break;
  }
  return plan;
}

// Plans live for the life of the process (never destroyed, so no descriptor outlives the
// library at exit). Planning runs outside the lock: benchmarking a shape takes
// milliseconds, and other shapes need not wait for it. Two threads planning the same key
// at once both plan; the first to finish is kept.
ConvPlan& cached_plan(const ConvCall& call, int device, const FindBuffers& buffers) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<ConvKey, std::unique_ptr<ConvPlan>, ConvKeyHash>();
  const NumericsOptions options = numerics();
  const ConvShape& s = call.s;
  const ops::Conv2dParams& p = call.p;
  const ConvKey key{call.direction,
                    p.compute,
                    device,
                    options.cudnn_benchmark,
                    options.deterministic,
                    options.allow_tf32,
                    p.channels_last,
                    {s.n, s.c, s.h, s.w, s.o, s.kh, s.kw, s.oh, s.ow, p.stride_h, p.stride_w,
                     p.pad_h, p.pad_w, s.g, p.dilation_h, p.dilation_w}};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache->find(key); it != cache->end()) return *it->second;
  }
  std::unique_ptr<ConvPlan> plan = make_plan(key, s, p, buffers, call.str());
  std::lock_guard<std::mutex> lock(mu);
  return *cache->emplace(key, std::move(plan)).first->second;
}

// Runs `launch(candidate, conv descriptor, workspace pointer, workspace bytes)`, which
// returns the status of the cuDNN call `call`, with the plan's first algorithm whose
// workspace can be allocated and that cuDNN runs (Note [cuDNN convolution plans]). A
// NOT_SUPPORTED status is cuDNN refusing that algorithm before launching anything, so the
// next one is tried; any other failure is an error.
template <class Launch>
void run_plan(ConvPlan& plan, int device, const char* call, const ConvCall& what,
              const Launch& launch) {
  std::string failures;
  for (size_t i = plan.first_candidate.load(std::memory_order_relaxed);
       i < plan.candidates.size(); ++i) {
    const Candidate& c = plan.candidates[i];
    Tensor ws;
    try {
      ws = cuda::workspace(device, c.workspace_bytes);
    } catch (const OutOfMemoryError& e) {
      failures += fmt::format("; algorithm {}: {}", c.algo, e.what());
      continue;
    }
    const cudnnStatus_t status =
        launch(c, plan.conv_for(c.math), ws.defined() ? ws.raw_data() : nullptr,
               c.workspace_bytes);
    // `ws` is released at the end of this iteration, after the call is queued (as
    // workspace() in library_handles.h asks).
    if (status == CUDNN_STATUS_SUCCESS) {
      // Later calls start at the algorithm that worked.
      size_t expected = plan.first_candidate.load(std::memory_order_relaxed);
      if (i > expected) plan.first_candidate.compare_exchange_strong(expected, i);
      return;
    }
    if (CUDNN_STATUS_CATEGORY(status) != CUDNN_STATUS_NOT_SUPPORTED) {
      cuda::throw_cudnn_error(status, call, what.str(), __FILE__, __LINE__);
    }
    failures += fmt::format("; algorithm {}: {} from {}", c.algo, cudnnGetErrorString(status),
                            call);
  }
  throw Error(fmt::format("{}: none of the {} algorithms planned for this convolution could "
                          "run{}",
                          what.str(), plan.candidates.size(), failures));
}

// The bias and its gradient, the same whichever API runs the convolution: y [n,o,oh,ow]
// and b [1,o,1,1], both float32 (Note [16-bit kernels on the GPU]), per output shape,
// kept for the life of the process as the plans are. For a float32 y or dy, or the
// float32 scratch output of a 16-bit y; 16-bit ones go to detail::add_channel_bias and
// detail::channel_sums.
struct BiasDescriptors {
  explicit BiasDescriptors(const std::string& context) : y(context), bias(context) {}
  TensorDesc y, bias;
};

const BiasDescriptors& bias_descriptors(const ConvCall& call) {
  static std::mutex mu;
  static auto* cache = new std::map<std::array<int64_t, 5>, std::unique_ptr<BiasDescriptors>>();
  const ConvShape& s = call.s;
  const std::array<int64_t, 5> key = {s.n, s.o, s.oh, s.ow, call.p.channels_last};
  const cudnnTensorFormat_t format = call.p.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  std::lock_guard<std::mutex> lock(mu);
  auto& entry = (*cache)[key];
  if (!entry) {
    const std::string context = call.str();
    auto d = std::make_unique<BiasDescriptors>(context);
    const auto i = [](int64_t v) { return static_cast<int>(v); };  // sizes checked by conv_shape
    MTRAIN_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d->y.get(), format, CUDNN_DATA_FLOAT, i(s.n), i(s.o), i(s.oh),
                                                  i(s.ow)),
                       context);
    MTRAIN_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d->bias.get(), format, CUDNN_DATA_FLOAT, 1, i(s.o), 1, 1),
                       context);
    entry = std::move(d);
  }
  return *entry;
}

// Runs `call` on cuDNN's graph API when NumericsOptions::cudnn_graph_api asks for it (Note
// [Convolutions on the graph API] in cudnn_graph.cpp), out = op(in0, in1) + beta * out with
// the operands of cuda::run_graph_convolution; false when the legacy plans are to run it.
bool ran_on_graph_api(int device, const ConvCall& call, const void* in0, const void* in1, void* out, float beta) {
  // Grouped or dilated: the legacy plans (GraphConvolution describes neither).
  if (!numerics().cudnn_graph_api || call.s.g != 1 || call.p.dilation_h != 1 || call.p.dilation_w != 1) return false;
  const ConvShape& s = call.s;
  cuda::GraphConvolution g;
  g.direction = call.direction == ConvDirection::Forward        ? cuda::GraphConvolution::Direction::Forward
                : call.direction == ConvDirection::BackwardData ? cuda::GraphConvolution::Direction::BackwardData
                                                                : cuda::GraphConvolution::Direction::BackwardWeights;
  g.data = call.p.compute == DType::BFloat16  ? CUDNN_DATA_BFLOAT16
           : call.p.compute == DType::Float16 ? CUDNN_DATA_HALF
                                              : CUDNN_DATA_FLOAT;
  g.n = s.n, g.c = s.c, g.h = s.h, g.w = s.w, g.o = s.o, g.kh = s.kh, g.kw = s.kw, g.oh = s.oh, g.ow = s.ow;
  g.stride_h = call.p.stride_h, g.stride_w = call.p.stride_w, g.pad_h = call.p.pad_h, g.pad_w = call.p.pad_w;
  g.beta = beta;
  g.channels_last = call.p.channels_last;
  return cuda::run_graph_convolution(device, g, in0, in1, out, call.str());
}

// cuDNN's legacy descriptors take int sizes, and it indexes tensors with int.
void check_fits_int(const char* op, const char* name, const Tensor& t) {
  if (t.numel() > INT_MAX) {
    throw InvalidArgument(fmt::format(
        "{} on the GPU: {} {} has {} elements, more than cuDNN's convolution addresses (2^31 - "
        "1); use a smaller batch",
        op, name, shape_str(t.shape()), t.numel()));
  }
}

// `t`, an activation, is defined, on `device` and float32, bfloat16 or float16.
void check_activation(const char* op, const char* name, const Tensor& t, Device device) {
  MTRAIN_CHECK(t.defined() && is_floating(t.dtype()),
               "{}: {} must be a float32, bfloat16 or float16 tensor, found {}", op, name,
               t.defined() ? t.str() : "undefined");
  check_on(op, name, t, device, t.dtype());
}

// Checks x[N,C,H,W] against w[O,C,KH,KW] and y[N,O,OH,OW] (names as the op sees them),
// all on the device of `x` (which the dispatch guarantees is a GPU). x and y are
// activations (check_activation), w float32.
ConvShape conv_shape(const char* op, const char* x_name, const Tensor& x, const Tensor& w,
                     const char* y_name, const Tensor& y, const ops::Conv2dParams& p) {
  MTRAIN_CHECK(p.stride_h >= 1 && p.stride_w >= 1 && p.pad_h >= 0 && p.pad_w >= 0 && p.groups >= 1 &&
                   p.dilation_h >= 1 && p.dilation_w >= 1,
               "{}: invalid stride {}x{} / padding {}x{} / groups {} / dilation {}x{}", op, p.stride_h, p.stride_w,
               p.pad_h, p.pad_w, p.groups, p.dilation_h, p.dilation_w);
  MTRAIN_CHECK(x.defined() && x.device().is_cuda(), "{}: {} must be a GPU tensor, found {}", op,
               x_name, x.str());
  const Device device = x.device();
  check_activation(op, x_name, x, device);
  check_on(op, "w", w, device);
  check_activation(op, y_name, y, device);
  check_ndim(op, x_name, x, 4);
  check_ndim(op, "w", w, 4);
  // Channels last (Note [Channels last] in tensor/ops.h): x and y are [N, H, W, C].
  ConvShape s = p.channels_last
                    ? ConvShape{x.size(0), x.size(3), x.size(1), x.size(2), w.size(0), w.size(2), w.size(3), 0, 0}
                    : ConvShape{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3), 0, 0};
  s.g = p.groups;
  MTRAIN_CHECK(s.c % s.g == 0 && s.o % s.g == 0 && w.size(1) * s.g == s.c,
               "{}: w {} in {} groups expects {} input channels, {} {} has {}", op, shape_str(w.shape()), s.g,
               w.size(1) * s.g, x_name, shape_str(x.shape()), s.c);
  s.oh = ops::conv_out_size(s.h, s.kh, p.stride_h, p.pad_h, p.dilation_h);
  s.ow = ops::conv_out_size(s.w, s.kw, p.stride_w, p.pad_w, p.dilation_w);
  MTRAIN_CHECK(s.kh >= 1 && s.kw >= 1 && s.oh >= 1 && s.ow >= 1,
               "{}: kernel {}x{} with padding {}x{} does not fit {} {}", op, s.kh, s.kw, p.pad_h,
               p.pad_w, x_name, shape_str(x.shape()));
  check_on_shape(op, y_name, y, device,
                 p.channels_last ? Shape{s.n, s.oh, s.ow, s.o} : Shape{s.n, s.o, s.oh, s.ow}, y.dtype());
  check_fits_int(op, x_name, x);
  check_fits_int(op, "w", w);
  check_fits_int(op, y_name, y);
  return s;
}

// The output of one call (Note [16-bit kernels on the GPU]): the tensor itself when it
// is in the compute type, else a scratch output in the compute type (the inputs:
// detail::compute_operand), which finish_output then converts into it.
void* output_in(Tensor& t, DType compute, Tensor& keep) {
  if (t.dtype() == compute) return t.raw_data();
  keep = Tensor::empty(t.shape(), compute, t.device());
  return keep.raw_data();
}

// t = the scratch output `keep` of output_in, converted (a float32 t: widened, as before;
// a 16-bit t of another type than the compute type: through float32); nothing when the
// call wrote t itself.
void finish_output(const Tensor& keep, Tensor& t) {
  if (!keep.defined()) return;
  if (t.dtype() == DType::Float32) {
    detail::widen_into(keep, t, /*accumulate=*/false);
  } else {
    detail::convert_between(keep, t);
  }
}

// The weight as a call reads it: w itself, or for channels-last data its [O, KH, KW, C]
// copy (Note [Channels last] in tensor/ops.h: cuDNN's NHWC kernels take the filter in the
// layout of the data).
const Tensor& weights_for(const Tensor& w, const ops::Conv2dParams& p, Tensor& keep) {
  if (!p.channels_last) return w;
  keep = Tensor::empty({w.size(0), w.size(2), w.size(3), w.size(1)}, DType::Float32, w.device());
  to_channels_last(w, keep);
  return keep;
}

// dw (+)= `last`, a weight gradient in [O, KH, KW, C], in dw's [O, C, KH, KW] order.
void put_weight_gradient(const Tensor& last, Tensor& dw, bool accumulate) {
  if (!accumulate) return from_channels_last(last, dw);
  Tensor ordered = Tensor::empty(dw.shape(), DType::Float32, dw.device());
  from_channels_last(last, ordered);
  add_(dw, ordered, 1.0f);
}

void check_compute(const char* op, DType compute) {
  MTRAIN_CHECK(compute == DType::Float32 || compute == DType::BFloat16 || compute == DType::Float16,
               "{}: no compute type {}", op, dtype_name(compute));
}

}  // namespace

void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                    const ops::Conv2dParams& p) {
  const ConvDirection dir = ConvDirection::Forward;
  const ConvShape s = conv_shape(op_name(dir), "x", x, w, "y", y, p);
  check_compute(op_name(dir), p.compute);
  const int device = x.device().index;
  if (b.defined()) check_on_shape(op_name(dir), "b", b, x.device(), {s.o});
  if (s.n == 0 || s.o == 0) return;
  cuda::DeviceGuard guard(device);
  Tensor x16, w16, y16, w_last;
  const void* px = detail::compute_operand(x, p.compute, x16);
  const void* pw = detail::compute_operand(weights_for(w, p, w_last), p.compute, w16);
  void* py = output_in(y, p.compute, y16);  // y16: a scratch in the compute type, if any
  const ConvCall what{dir, s, p};
  const float one = 1.0f, zero = 0.0f;
  if (!ran_on_graph_api(device, what, px, pw, py, zero)) {
    ConvPlan& plan = cached_plan(what, device, {px, pw, y.shape(), p.compute});
    std::lock_guard<std::mutex> lock(plan.mu);
    cudnnHandle_t handle = cuda::cudnn_handle(device);
    run_plan(plan, device, "cudnnConvolutionForward", what,
             [&](const Candidate& c, cudnnConvolutionDescriptor_t conv, void* ws, size_t ws_bytes) {
               return cudnnConvolutionForward(handle, &one, plan.x.get(), px, plan.w.get(), pw, conv,
                                              static_cast<cudnnConvolutionFwdAlgo_t>(c.algo), ws,
                                              ws_bytes, &zero, plan.y.get(), py);
             });
  }
  // y += b broadcast over n, h, w, in float32.
  const auto add_bias = [&](Tensor& y32) {
    const BiasDescriptors& d = bias_descriptors(what);
    MTRAIN_CUDNN_CHECK(cudnnAddTensor(cuda::cudnn_handle(device), &one, d.bias.get(), b.raw_data(), &one,
                                      d.y.get(), y32.raw_data()),
                       what.str());
  };
  if (!b.defined() || y.dtype() == DType::Float32) {
    finish_output(y16, y);
    if (b.defined()) add_bias(y);
    return;
  }
  if (p.compute == DType::Float32) {
    // A 16-bit y, float32 compute: cuDNN wrote the float32 scratch y16; the bias is added
    // there as for a float32 y, and the sum rounded once into y.
    add_bias(y16);
    detail::convert_between(y16, y);
    return;
  }
  // A 16-bit y, 16-bit compute: cuDNN wrote its output in 16 bits (y itself, or the
  // scratch y16 of the other 16-bit type), and one pass over it adds the bias in float32
  // and rounds into y: round(round16(conv) + b), two roundings. autocast rounds the same
  // way: its convolution's output is 16-bit before the bias is added, PyTorch adding a
  // cuDNN convolution's bias to that 16-bit output.
  detail::add_channel_bias(y16.defined() ? y16 : y, b, p.channels_last, y);
}

void conv2d_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                          const ops::Conv2dParams& p) {
  const ConvDirection dir = ConvDirection::BackwardData;
  // The GPU checks key on the first tensor's device, which for this op is dy's.
  MTRAIN_CHECK(dy.defined() && dy.device().is_cuda(), "{}: dy must be a GPU tensor, found {}",
               op_name(dir), dy.str());
  check_activation(op_name(dir), "dx", dx, dy.device());
  const ConvShape s = conv_shape(op_name(dir), "dx", dx, w, "dy", dy, p);
  check_compute(op_name(dir), p.compute);
  const int device = dx.device().index;
  if (s.n == 0 || s.c == 0) return;
  cuda::DeviceGuard guard(device);
  if (s.o == 0) {
    dx.zero_();
    return;
  }
  Tensor dy16, w16, dx16, w_last;
  const void* pdy = detail::compute_operand(dy, p.compute, dy16);
  const void* pw = detail::compute_operand(weights_for(w, p, w_last), p.compute, w16);
  void* pdx = output_in(dx, p.compute, dx16);
  const ConvCall what{dir, s, p};
  const float one = 1.0f, zero = 0.0f;
  if (!ran_on_graph_api(device, what, pw, pdy, pdx, zero)) {
    ConvPlan& plan = cached_plan(what, device, {pw, pdy, dx.shape(), p.compute});
    std::lock_guard<std::mutex> lock(plan.mu);
    cudnnHandle_t handle = cuda::cudnn_handle(device);
    run_plan(plan, device, "cudnnConvolutionBackwardData", what,
             [&](const Candidate& c, cudnnConvolutionDescriptor_t conv, void* ws, size_t ws_bytes) {
               return cudnnConvolutionBackwardData(
                   handle, &one, plan.w.get(), pw, plan.y.get(), pdy, conv,
                   static_cast<cudnnConvolutionBwdDataAlgo_t>(c.algo), ws, ws_bytes, &zero,
                   plan.x.get(), pdx);
             });
  }
  finish_output(dx16, dx);
}

void conv2d_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db,
                             const ops::Conv2dParams& p, bool accumulate) {
  const ConvDirection dir = ConvDirection::BackwardWeights;
  const ConvShape s = conv_shape(op_name(dir), "x", x, dw, "dy", dy, p);
  check_compute(op_name(dir), p.compute);
  const int device = x.device().index;
  if (db.defined()) check_on_shape(op_name(dir), "db", db, x.device(), {s.o});
  cuda::DeviceGuard guard(device);
  if (s.n == 0 || s.o == 0 || s.c == 0) {
    // An empty batch contributes nothing to the gradient (as the CPU kernel).
    if (!accumulate) {
      dw.zero_();
      if (db.defined()) db.zero_();
    }
    return;
  }
  Tensor x16, dy16, dw16, dw_last;
  const void* px = detail::compute_operand(x, p.compute, x16);
  const void* pdy = detail::compute_operand(dy, p.compute, dy16);
  // Channels last: the gradient comes in [O, KH, KW, C] and is put into dw at the end.
  Tensor& dw_out =
      p.channels_last ? (dw_last = Tensor::empty({s.o, s.kh, s.kw, s.c / s.g}, DType::Float32, dw.device())) : dw;
  const bool accumulate_out = accumulate && !p.channels_last;
  void* pdw = output_in(dw_out, p.compute, dw16);
  const ConvCall what{dir, s, p};
  const float one = 1.0f;
  const float beta = accumulate ? 1.0f : 0.0f;
  // A 16-bit dw is written whole, then added into the float32 gradient.
  const float filter_beta = dw16.defined() || !accumulate_out ? 0.0f : 1.0f;
  if (!ran_on_graph_api(device, what, px, pdy, pdw, filter_beta)) {
    ConvPlan& plan = cached_plan(what, device, {px, pdy, dw.shape(), p.compute});
    std::lock_guard<std::mutex> lock(plan.mu);
    cudnnHandle_t handle = cuda::cudnn_handle(device);
    run_plan(plan, device, "cudnnConvolutionBackwardFilter", what,
             [&](const Candidate& c, cudnnConvolutionDescriptor_t conv, void* ws, size_t ws_bytes) {
               return cudnnConvolutionBackwardFilter(
                   handle, &one, plan.x.get(), px, plan.y.get(), pdy, conv,
                   static_cast<cudnnConvolutionBwdFilterAlgo_t>(c.algo), ws, ws_bytes, &filter_beta,
                   plan.w.get(), pdw);
             });
  }
  if (dw16.defined()) detail::widen_into(dw16, dw_out, accumulate_out);
  if (p.channels_last) put_weight_gradient(dw_last, dw, accumulate);
  if (db.defined() && dy.dtype() != DType::Float32) {
    // A 16-bit dy: its values summed per channel in double, in a fixed order, read in 16
    // bits (no float32 copy), rounded to float once (with the old db when accumulating).
    detail::channel_sums(dy, p.channels_last, db, accumulate);
  } else if (db.defined()) {
    // From the float32 dy, as the linear layers' bias gradient.
    const BiasDescriptors& d = bias_descriptors(what);
    MTRAIN_CUDNN_CHECK(cudnnConvolutionBackwardBias(cuda::cudnn_handle(device), &one, d.y.get(), dy.raw_data(),
                                                    &beta, d.bias.get(), db.raw_data()),
                       what.str());
  }
}

}  // namespace mtrain::cuda_ops
