// 2-D convolution on oneDNN primitives, cached per shape.
//
// Note [Convolution primitive cache]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Creating a oneDNN primitive costs far more than running a small one (JIT code
// generation), and training repeats the same few shapes every step. So every
// (direction, shapes, stride, padding, bias, accumulate, layout) combination gets one
// cache entry holding the primitive, its bound arguments (Note [Bound primitive
// arguments]) and the argument map, created on first use and kept for the life of
// the process. The cache lock only covers lookup; an entry's own mutex serialises its
// executions because its bound memory objects and internal buffers are per entry.
#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "tensor/cpu/checks.h"
#include "tensor/cpu/conv_direct.h"
#include "tensor/cpu/conv_gemm_weights.h"
#include "tensor/cpu/conv_lanes.h"
#include "tensor/cpu/conv_layout.h"
#include "tensor/cpu/conv_winograd.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/dnnl_support.h"
#include "tensor/cpu/mixed_precision.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

using dnnl::memory;
using cpu::BoundArg;
using cpu::ConvLayout;
using Role = BoundArg::Role;

enum class ConvDirection : uint8_t { Forward, BackwardData, BackwardWeights };

// Sizes of one convolution: x[n,c,h,w] * w[o,c/g,kh,kw] -> y[n,o,oh,ow], in g groups.
struct ConvShape {
  int64_t n, c, h, w, o, kh, kw, oh, ow;
  int64_t g = 1;
};

struct ConvKey {
  ConvDirection direction;
  DType compute;
  bool bias;
  bool accumulate;
  bool blocked;
  std::array<int64_t, 16> dims;
  bool operator==(const ConvKey&) const = default;
};

struct ConvKeyHash {
  size_t operator()(const ConvKey& k) const {
    size_t h = (static_cast<size_t>(k.direction) * 8 + static_cast<size_t>(k.compute)) * 8 +
               k.bias * 4 + k.accumulate * 2 + k.blocked;
    for (int64_t d : k.dims) h = h * 1000003u ^ static_cast<size_t>(d);
    return h;
  }
};

// The most arguments an entry binds: forward's x, w, b and y.
constexpr size_t kMaxBoundArgs = 4;

struct ConvEntry {
  std::mutex mu;
  dnnl::primitive primitive;
  // Inputs first, then outputs, in the order run_entry() receives the pointers.
  std::vector<BoundArg> inputs;
  std::vector<BoundArg> outputs;
  std::unordered_map<int, memory> args;
};

std::atomic<ConvLayout>& layout_setting() {
  static std::atomic<ConvLayout> layout{ConvLayout::Auto};
  return layout;
}

std::atomic<long> primitives_created{0};

// Note [Convolution layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// oneDNN's fastest convolutions use blocked layouts (nChw16c), but our tensors are
// NCHW, so a blocked primitive pays a reorder of its input and output every call.
// Measured with tests/tensor/bench_kernels (1 thread, process CPU ms, AVX-512 EPYC,
// reorders included), blocked wins clearly for every 3x3 ResNet convolution (64->64
// @28: 69/70/73 ms vs plain 104/113/125 for fwd/bwd-data/bwd-weights; 512->512 @4:
// 74/67/190 vs 135/172/256) and for LeNet's 5x5 convolutions (6->16: 1.3/3.3/2.3 vs
// 3.6/4.6/4.2). Plain wins for 1x1 shortcuts (6.4/6.6/8.8 vs 9.2/9.5/10.4), where the
// reorders cost as much as the convolution, and for backward-data with very few
// input channels (1->6 5x5: 4.3 vs 23.5), where oneDNN has no fast blocked kernel
// (at 6 input channels blocked already wins: 3.5 vs 4.6). Own kernels take over where
// they measured faster: the forward of a single input channel with few outputs (Note
// [Single-channel convolution] in conv_direct.cpp); the gradients of convolutions with
// few channels, such as both of LeNet's, with images in the vector lanes (Note [Images
// in the vector lanes] in conv_lanes.cpp); weight gradients over at most 16 output
// positions as one sgemm (Note [Weight gradients as a GEMM] in conv_gemm_weights.cpp);
// and forward and backward-data of 3x3 convolutions with many channels (on AVX2 CPUs
// their weight gradients too) as Winograd F(2x2, 3x3) (Note [Winograd convolution] in
// conv_winograd.cpp).
bool choose_blocked(ConvDirection direction, const ConvShape& s, DType compute) {
  // oneDNN's 16-bit convolutions are the blocked ones (Note [Reduced-precision compute]).
  if (compute != DType::Float32) return true;
  switch (layout_setting().load(std::memory_order_relaxed)) {
    case ConvLayout::Plain: return false;
    case ConvLayout::Blocked: return true;
    case ConvLayout::Auto: break;
  }
  if (s.kh == 1 && s.kw == 1) return false;
  if (direction == ConvDirection::BackwardData && s.c < 4) return false;
  return true;
}

memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::Float32: return memory::data_type::f32;
    case DType::BFloat16: return memory::data_type::bf16;
    case DType::Float16: return memory::data_type::f16;
    default: break;
  }
  MTRAIN_CHECK(false, "convolution: no oneDNN compute type for {}", dtype_name(t));
  return memory::data_type::undef;
}

// The caller's memory: float32, NCHW / OIHW / x.
memory::desc plain_md(const memory::dims& dims, memory::data_type type = memory::data_type::f32) {
  static constexpr memory::format_tag kTagByRank[] = {
      memory::format_tag::undef, memory::format_tag::x, memory::format_tag::nc,
      memory::format_tag::abc, memory::format_tag::nchw, memory::format_tag::goihw};
  return memory::desc(dims, type, kTagByRank[dims.size()]);
}

// What the primitive computes on: `type` (the compute type for the multiplied inputs,
// float32 for outputs), in the layout oneDNN prefers when blocked. The BoundArg reorders
// convert both layout and type (Note [Bound primitive arguments]).
memory::desc maybe_any(const memory::dims& dims, bool blocked,
                       memory::data_type type = memory::data_type::f32) {
  return blocked ? memory::desc(dims, type, memory::format_tag::any) : plain_md(dims, type);
}

struct ConvDescs {
  memory::dims x, w, b, y, strides, dilates, pad;
};

// Grouped weights are oneDNN's goihw, which is mtrain's [O, C/g, KH, KW] read as
// [g, O/g, C/g, KH, KW].
ConvDescs conv_dims(const ConvShape& s, const Conv2dParams& p) {
  const memory::dims w = s.g == 1 ? memory::dims{s.o, s.c, s.kh, s.kw}
                                  : memory::dims{s.g, s.o / s.g, s.c / s.g, s.kh, s.kw};
  // oneDNN counts the gaps between taps: 0 where PyTorch says dilation 1.
  return {{s.n, s.c, s.h, s.w}, w,      {s.o}, {s.n, s.o, s.oh, s.ow}, {p.stride_h, p.stride_w},
          {p.dilation_h - 1, p.dilation_w - 1}, {p.pad_h, p.pad_w}};
}

// `in` is the type of x and w; `out` that of y (the backward passes' hint has y in the
// compute type too, as their dy is).
dnnl::convolution_forward::primitive_desc forward_pd(const ConvDescs& d, bool bias, bool blocked,
                                                     memory::data_type in = memory::data_type::f32,
                                                     memory::data_type out = memory::data_type::f32) {
  using fwd = dnnl::convolution_forward;
  const auto x = maybe_any(d.x, blocked, in), w = maybe_any(d.w, blocked, in),
             y = maybe_any(d.y, blocked, out);
  // Padding on the right equals padding on the left: oneDNN checks
  // (in - k + pad_l + pad_r) / stride + 1 == out with floor division, as PyTorch sizes it.
  const auto desc = bias ? fwd::desc(dnnl::prop_kind::forward_training,
                                     dnnl::algorithm::convolution_direct, x, w, plain_md(d.b), y,
                                     d.strides, d.dilates, d.pad, d.pad)
                         : fwd::desc(dnnl::prop_kind::forward_training,
                                     dnnl::algorithm::convolution_direct, x, w, y, d.strides,
                                     d.dilates, d.pad, d.pad);
  return fwd::primitive_desc(desc, cpu::dnnl_engine());
}

std::unique_ptr<ConvEntry> make_entry(const ConvKey& key, const ConvShape& s,
                                      const Conv2dParams& p) {
  auto e = std::make_unique<ConvEntry>();
  const ConvDescs d = conv_dims(s, p);
  const bool blocked = key.blocked;
  const Role out_role = key.accumulate ? Role::AccumulatedOutput : Role::Output;
  // Note [Reduced-precision compute]: x, w and dy in the compute type, outputs float32.
  const memory::data_type in = dnnl_type(key.compute), f32 = memory::data_type::f32;
  switch (key.direction) {
    case ConvDirection::Forward: {
      const auto pd = forward_pd(d, key.bias, blocked, in, f32);
      e->primitive = dnnl::convolution_forward(pd);
      e->inputs.emplace_back(plain_md(d.x), pd.src_desc(), Role::Input);
      e->inputs.emplace_back(plain_md(d.w), pd.weights_desc(), Role::Input);
      if (key.bias) e->inputs.emplace_back(plain_md(d.b), pd.bias_desc(), Role::Input);
      e->outputs.emplace_back(plain_md(d.y), pd.dst_desc(), Role::Output);
      e->args = {{DNNL_ARG_SRC, e->inputs[0].primitive_memory()},
                 {DNNL_ARG_WEIGHTS, e->inputs[1].primitive_memory()},
                 {DNNL_ARG_DST, e->outputs[0].primitive_memory()}};
      if (key.bias) e->args.emplace(DNNL_ARG_BIAS, e->inputs[2].primitive_memory());
      break;
    }
    case ConvDirection::BackwardData: {
      using bwd = dnnl::convolution_backward_data;
      const auto hint = forward_pd(d, false, blocked, in, in);
      const bwd::desc desc(dnnl::algorithm::convolution_direct, maybe_any(d.x, blocked, f32),
                           maybe_any(d.w, blocked, in), maybe_any(d.y, blocked, in), d.strides,
                           d.dilates, d.pad, d.pad);
      const bwd::primitive_desc pd(desc, cpu::dnnl_engine(), hint);
      e->primitive = bwd(pd);
      e->inputs.emplace_back(plain_md(d.y), pd.diff_dst_desc(), Role::Input);
      e->inputs.emplace_back(plain_md(d.w), pd.weights_desc(), Role::Input);
      e->outputs.emplace_back(plain_md(d.x), pd.diff_src_desc(), Role::Output);
      e->args = {{DNNL_ARG_DIFF_DST, e->inputs[0].primitive_memory()},
                 {DNNL_ARG_WEIGHTS, e->inputs[1].primitive_memory()},
                 {DNNL_ARG_DIFF_SRC, e->outputs[0].primitive_memory()}};
      break;
    }
    case ConvDirection::BackwardWeights: {
      using bwd = dnnl::convolution_backward_weights;
      const auto hint = forward_pd(d, key.bias, blocked, in, in);
      const auto x = maybe_any(d.x, blocked, in), w = maybe_any(d.w, blocked, f32),
                 y = maybe_any(d.y, blocked, in);
      const auto desc =
          key.bias ? bwd::desc(dnnl::algorithm::convolution_direct, x, w, plain_md(d.b), y,
                               d.strides, d.dilates, d.pad, d.pad)
                   : bwd::desc(dnnl::algorithm::convolution_direct, x, w, y, d.strides, d.dilates,
                               d.pad, d.pad);
      const bwd::primitive_desc pd(desc, cpu::dnnl_engine(), hint);
      e->primitive = bwd(pd);
      e->inputs.emplace_back(plain_md(d.x), pd.src_desc(), Role::Input);
      e->inputs.emplace_back(plain_md(d.y), pd.diff_dst_desc(), Role::Input);
      e->outputs.emplace_back(plain_md(d.w), pd.diff_weights_desc(), out_role);
      if (key.bias) e->outputs.emplace_back(plain_md(d.b), pd.diff_bias_desc(), out_role);
      e->args = {{DNNL_ARG_SRC, e->inputs[0].primitive_memory()},
                 {DNNL_ARG_DIFF_DST, e->inputs[1].primitive_memory()},
                 {DNNL_ARG_DIFF_WEIGHTS, e->outputs[0].primitive_memory()}};
      if (key.bias) e->args.emplace(DNNL_ARG_DIFF_BIAS, e->outputs[1].primitive_memory());
      break;
    }
  }
  MTRAIN_CHECK(e->inputs.size() + e->outputs.size() <= kMaxBoundArgs,
               "conv entry binds {} arguments, more than kMaxBoundArgs",
               e->inputs.size() + e->outputs.size());
  primitives_created.fetch_add(1, std::memory_order_relaxed);
  return e;
}

ConvEntry& cached_entry(ConvDirection direction, const ConvShape& s, const Conv2dParams& p,
                        bool bias, bool accumulate) {
  static std::mutex mu;
  static std::unordered_map<ConvKey, std::unique_ptr<ConvEntry>, ConvKeyHash> cache;
  const ConvKey key{direction, p.compute, bias, accumulate, choose_blocked(direction, s, p.compute),
                    {s.n, s.c, s.h, s.w, s.o, s.kh, s.kw, s.oh, s.ow, p.stride_h, p.stride_w,
                     p.pad_h, p.pad_w, s.g, p.dilation_h, p.dilation_w}};
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make_entry(key, s, p)).first;
  return *it->second;
}

void run_entry(ConvEntry& e, std::initializer_list<const void*> inputs,
               std::initializer_list<void*> outputs) {
  std::lock_guard<std::mutex> lock(e.mu);
  dnnl::stream& s = cpu::dnnl_stream();
  size_t i = 0;
  for (const void* p : inputs) e.inputs[i++].bind(const_cast<void*>(p));
  i = 0;
  for (void* p : outputs) e.outputs[i++].bind(p);
  // Note [Staging from the tensor cache] (dnnl_support.h): one block per argument, held
  // until the stream is done with it.
  std::array<Tensor, kMaxBoundArgs> staging;
  size_t held = 0;
  for (auto* args : {&e.inputs, &e.outputs}) {
    for (BoundArg& a : *args) {
      if (a.internal_bytes() == 0) continue;
      staging[held] = Tensor::empty({static_cast<int64_t>(a.internal_bytes())}, DType::UInt8);
      a.bind_internal(staging[held++].raw_data());
    }
  }
  for (BoundArg& a : e.inputs) a.before(s);
  e.primitive.execute(s, e.args);
  for (BoundArg& a : e.outputs) a.after(s);
  s.wait();
}

void check_params(const char* op, const Conv2dParams& p) {
  MTRAIN_CHECK(p.stride_h >= 1 && p.stride_w >= 1 && p.pad_h >= 0 && p.pad_w >= 0 && p.groups >= 1 &&
                   p.dilation_h >= 1 && p.dilation_w >= 1,
               "{}: invalid stride {}x{} / padding {}x{} / groups {} / dilation {}x{}", op, p.stride_h, p.stride_w,
               p.pad_h, p.pad_w, p.groups, p.dilation_h, p.dilation_w);
}

// Checks x[N,C,H,W] against w[O,C,KH,KW] and y[N,O,OH,OW] (names as the op sees them).
ConvShape conv_shape(const char* op, const char* x_name, const Tensor& x, const Tensor& w,
                     const char* y_name, const Tensor& y, const Conv2dParams& p) {
  check_params(op, p);
  cpu::check_float(op, x_name, x);
  cpu::check_float(op, "w", w);
  cpu::check_float(op, y_name, y);
  cpu::check_ndim(op, x_name, x, 4);
  cpu::check_ndim(op, "w", w, 4);
  ConvShape s{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3), 0, 0, p.groups};
  MTRAIN_CHECK(s.c % s.g == 0 && s.o % s.g == 0 && w.size(1) * s.g == s.c,
               "{}: w {} in {} groups expects {} input channels, {} {} has {}", op, shape_str(w.shape()), s.g,
               w.size(1) * s.g, x_name, shape_str(x.shape()), s.c);
  s.oh = conv_out_size(s.h, s.kh, p.stride_h, p.pad_h, p.dilation_h);
  s.ow = conv_out_size(s.w, s.kw, p.stride_w, p.pad_w, p.dilation_w);
  MTRAIN_CHECK(s.kh >= 1 && s.kw >= 1 && s.oh >= 1 && s.ow >= 1,
               "{}: kernel {}x{} with padding {}x{} does not fit {} {}", op, s.kh, s.kw, p.pad_h,
               p.pad_w, x_name, shape_str(x.shape()));
  cpu::check_shape(op, y_name, y, {s.n, s.o, s.oh, s.ow});
  return s;
}

// Note [Own kernels under --amp]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With a 16-bit compute type the own float32 kernels for few channels (direct, lanes)
// still take the shapes they were chosen for, on operands rounded to that type first
// (cpu::rounded_operand): a float32 kernel on rounded operands is what Note
// [Reduced-precision compute] defines the 16-bit result to be, and with so few channels
// oneDNN's 16-bit kernels do no better than its float32 ones. Measured with --amp bf16,
// three interleaved pairs of 1-rank runs (scripts/bench-ddp.sh --nprocs 1 --runs 1
// --amp bf16 --no-torch): LeNet, whose first layer and whose gradients are such shapes
// (its second layer's forward, 6 input channels, is oneDNN's), 12.8-15.1k img/s with
// every convolution on oneDNN's bf16 kernels, 21.9-24.7k with the own ones. The kernels
// for many channels stay float32-only: Winograd's shapes run at twice its speed on
// oneDNN's bf16 kernels, and with the GEMM weight gradient (512 channels at 4x4)
// resnet18 fell from 61.5-66.4 to 57.8-59.0 img/s. Rounding costs a pass over each
// operand; the bias gradient sums the float32 dy.

// The own kernels take one group and no dilation; the others are oneDNN's.
bool own_kernel_fits(const ConvShape& s, const Conv2dParams& p) {
  return s.g == 1 && p.dilation_h == 1 && p.dilation_w == 1;
}

// The Auto policy's third choice: own kernels instead of a oneDNN primitive.
bool choose_direct(const ConvShape& s, const Conv2dParams& p) {
  return own_kernel_fits(s, p) && layout_setting().load(std::memory_order_relaxed) == ConvLayout::Auto &&
         cpu::direct_conv_applies(s.c, s.o, s.kh, s.kw, p.stride_h, p.stride_w);
}

cpu::DirectConvShape direct_shape(const ConvShape& s, const Conv2dParams& p) {
  return {s.n, s.h, s.w, s.o, s.kh, s.kw, p.pad_h, p.pad_w, s.oh, s.ow};
}

cpu::ConvGeometry geometry(const ConvShape& s, const Conv2dParams& p) {
  return {s.n, s.c, s.h, s.w, s.o, s.kh, s.kw, s.oh, s.ow, p.stride_h, p.stride_w, p.pad_h, p.pad_w};
}

// The Auto policy's choice for 3x3 convolutions with many channels: forward and
// backward-data, and with their own rule weight gradients (Note [Winograd convolution]
// in conv_winograd.cpp).
bool choose_winograd(ConvDirection direction, const ConvShape& s, const Conv2dParams& p) {
  if (!own_kernel_fits(s, p) || p.compute != DType::Float32 ||
      layout_setting().load(std::memory_order_relaxed) != ConvLayout::Auto) {
    return false;
  }
  const cpu::ConvGeometry g = geometry(s, p);
  return direction == ConvDirection::BackwardWeights ? cpu::winograd_weights_applies(g) : cpu::winograd_applies(g);
}

// The Auto policy's choice for the gradients of convolutions with few channels (Note
// [Images in the vector lanes] in conv_lanes.cpp).
bool choose_lanes(ConvDirection direction, const ConvShape& s, const Conv2dParams& p) {
  if (!own_kernel_fits(s, p) || layout_setting().load(std::memory_order_relaxed) != ConvLayout::Auto) return false;
  const cpu::ConvGeometry g = geometry(s, p);
  return direction == ConvDirection::BackwardData ? cpu::lanes_backward_data_applies(g)
                                                  : cpu::lanes_backward_weights_applies(g);
}

// The Auto policy's choice for weight gradients with few output positions (Note
// [Weight gradients as a GEMM] in conv_gemm_weights.cpp).
bool choose_gemm_weights(const ConvShape& s, const Conv2dParams& p) {
  return own_kernel_fits(s, p) && p.compute == DType::Float32 &&
         layout_setting().load(std::memory_order_relaxed) == ConvLayout::Auto && cpu::gemm_weights_applies(geometry(s, p));
}

// db[o] (+)= sum over n, oh, ow of dy[n, o, oh, ow]: each image's plane summed in
// float32 vector lanes, the planes in double.
void bias_gradient(const float* dy, const ConvShape& s, float* db, bool accumulate) {
  const int64_t plane = s.oh * s.ow;
#pragma omp parallel for if (s.n * s.o * plane > cpu::kParallelGrain)
  for (int64_t o = 0; o < s.o; ++o) {
    double sum = 0.0;
    for (int64_t n = 0; n < s.n; ++n) {
      const float* row = dy + (n * s.o + o) * plane;
      float part = 0.0f;
#pragma omp simd reduction(+ : part)
      for (int64_t i = 0; i < plane; ++i) part += row[i];
      sum += part;
    }
    db[o] = accumulate ? db[o] + static_cast<float>(sum) : static_cast<float>(sum);
  }
}

}  // namespace

namespace cpu {
bool conv_compute_supported(DType compute) {
  if (compute == DType::Float32) return true;
  if (compute != DType::BFloat16 && compute != DType::Float16) return false;
  // Whether oneDNN has the three primitives for this CPU: it throws `unimplemented`
  // where the ISA lacks them (bf16 before AVX-512; f16 in oneDNN 2.6 on every CPU measured,
  // one with AVX512_FP16 included).
  const ConvShape s{2, 16, 8, 8, 16, 3, 3, 8, 8};
  const Conv2dParams p{1, 1, 1, 1, compute};
  try {
    for (ConvDirection d : {ConvDirection::Forward, ConvDirection::BackwardData,
                            ConvDirection::BackwardWeights}) {
      const ConvKey key{d, compute, true, false, true, {}};
      make_entry(key, s, p);
    }
  } catch (const dnnl::error&) {
    return false;
  }
  return true;
}

void set_conv_layout(ConvLayout layout) { layout_setting().store(layout); }
ConvLayout conv_layout() { return layout_setting().load(); }
long conv_primitives_created() { return primitives_created.load(); }
}  // namespace cpu

int64_t conv_out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  MTRAIN_CHECK(s >= 1 && k >= 1 && p >= 0 && in >= 0 && d >= 1,
               "conv_out_size: invalid input {}, kernel {}, stride {}, padding {}, dilation {}", in, k, s, p, d);
  const int64_t span = in + 2 * p - (d * (k - 1) + 1);
  return span < 0 ? 0 : span / s + 1;
}

int64_t pool_out_size(int64_t in, int64_t k, int64_t s, int64_t p, bool ceil_mode) {
  MTRAIN_CHECK(s >= 1 && k >= 1 && p >= 0 && in >= 0,
               "pool_out_size: invalid input {}, kernel {}, stride {}, padding {}", in, k, s, p);
  // PyTorch's pooling_output_shape: the span divided rounding down (towards -inf), or up in
  // ceil mode, less a last window that would start in the right padding (it sees no input).
  const int64_t span = in + 2 * p - k + (ceil_mode ? s - 1 : 0);
  int64_t out = (span >= 0 ? span / s : -((-span + s - 1) / s)) + 1;
  if (ceil_mode && (out - 1) * s >= in + p) --out;
  return out < 0 ? 0 : out;
}

// Note [Channels last on the CPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The own kernels and the oneDNN primitives here are tuned for NCHW, and the CPU is not
// where channels last pays (Note [Channels last] in tensor/ops.h), so a channels-last call
// runs the NCHW kernel between transposes: the same bits as the NCHW call, two copies of
// the activation more.
namespace {

Tensor as_nchw(const Tensor& nhwc) {
  MTRAIN_CHECK(nhwc.ndim() == 4, "a channels-last convolution operand must be [N, H, W, C], found {}",
               shape_str(nhwc.shape()));
  Tensor t = Tensor::empty({nhwc.size(0), nhwc.size(3), nhwc.size(1), nhwc.size(2)});
  cpu::from_channels_last(nhwc, t);
  return t;
}

Tensor empty_nchw_of(const Tensor& nhwc) {
  MTRAIN_CHECK(nhwc.ndim() == 4, "a channels-last convolution operand must be [N, H, W, C], found {}",
               shape_str(nhwc.shape()));
  return Tensor::empty({nhwc.size(0), nhwc.size(3), nhwc.size(1), nhwc.size(2)});
}

Conv2dParams nchw(const Conv2dParams& p) {
  Conv2dParams q = p;
  q.channels_last = false;
  return q;
}

}  // namespace

void cpu::conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                         const Conv2dParams& p) {
  if (p.channels_last) {
    Tensor y_nchw = empty_nchw_of(y);
    cpu::conv2d_forward(as_nchw(x), w, b, y_nchw, nchw(p));
    return cpu::to_channels_last(y_nchw, y);
  }
  const ConvShape s = conv_shape("conv2d_forward", "x", x, w, "y", y, p);
  if (b.defined()) cpu::check_float_shape("conv2d_forward", "b", b, {s.o});
  if (s.n == 0 || s.o == 0) return;
  if (s.c == 0) {  // an empty sum: every output is its bias, as linear_forward with in == 0
    float* py = y.data<float>();
    const int64_t area = s.oh * s.ow;
    for (int64_t plane = 0; plane < s.n * s.o; ++plane) {
      std::fill_n(py + plane * area, area, b.defined() ? b.data<float>()[plane % s.o] : 0.0f);
    }
    return;
  }
  cpu::use_configured_threads();
  if (choose_direct(s, p)) {
    // Note [Own kernels under --amp]
    const Tensor xr = cpu::rounded_operand(x, p.compute), wr = cpu::rounded_operand(w, p.compute);
    return cpu::direct_conv_forward(xr.data<float>(), wr.data<float>(),
                                    b.defined() ? b.data<float>() : nullptr, y.data<float>(),
                                    direct_shape(s, p));
  }
  if (choose_winograd(ConvDirection::Forward, s, p)) {
    return cpu::winograd_conv_forward(x.data<float>(), w.data<float>(),
                                      b.defined() ? b.data<float>() : nullptr, y.data<float>(),
                                      geometry(s, p));
  }
  ConvEntry& e = cached_entry(ConvDirection::Forward, s, p, b.defined(), false);
  if (b.defined()) {
    run_entry(e, {x.raw_data(), w.raw_data(), b.raw_data()}, {y.raw_data()});
  } else {
    run_entry(e, {x.raw_data(), w.raw_data()}, {y.raw_data()});
  }
}

void cpu::conv2d_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx,
                               const Conv2dParams& p) {
  if (p.channels_last) {
    Tensor dx_nchw = empty_nchw_of(dx);
    cpu::conv2d_backward_data(as_nchw(dy), w, dx_nchw, nchw(p));
    return cpu::to_channels_last(dx_nchw, dx);
  }
  const ConvShape s = conv_shape("conv2d_backward_data", "dx", dx, w, "dy", dy, p);
  if (s.n == 0 || s.c == 0) return;
  cpu::use_configured_threads();
  if (s.o == 0) {
    dx.zero_();
    return;
  }
  if (choose_winograd(ConvDirection::BackwardData, s, p)) {
    return cpu::winograd_conv_backward_data(dy.data<float>(), w.data<float>(), dx.data<float>(),
                                            geometry(s, p));
  }
  if (choose_lanes(ConvDirection::BackwardData, s, p)) {
    const Tensor dyr = cpu::rounded_operand(dy, p.compute), wr = cpu::rounded_operand(w, p.compute);
    return cpu::lanes_conv_backward_data(dyr.data<float>(), wr.data<float>(), dx.data<float>(),
                                         geometry(s, p));
  }
  ConvEntry& e = cached_entry(ConvDirection::BackwardData, s, p, false, false);
  run_entry(e, {dy.raw_data(), w.raw_data()}, {dx.raw_data()});
}

void cpu::conv2d_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db,
                                  const Conv2dParams& p, bool accumulate) {
  if (p.channels_last) return cpu::conv2d_backward_weights(as_nchw(x), as_nchw(dy), dw, db, nchw(p), accumulate);
  const ConvShape s = conv_shape("conv2d_backward_weights", "x", x, dw, "dy", dy, p);
  if (db.defined()) cpu::check_float_shape("conv2d_backward_weights", "db", db, {s.o});
  cpu::use_configured_threads();
  if (s.n == 0 || s.o == 0 || s.c == 0) {
    // An empty batch contributes nothing to the gradient.
    if (!accumulate) {
      dw.zero_();
      if (db.defined()) db.zero_();
    }
    return;
  }
  // With a 16-bit compute type the bias gradient sums the float32 dy here (Note
  // [Reduced-precision compute]); the kernels below would sum the rounded one.
  const bool separate_bias = p.compute != DType::Float32 && db.defined();
  float* const kernel_db = db.defined() && !separate_bias ? db.data<float>() : nullptr;
  if (choose_winograd(ConvDirection::BackwardWeights, s, p)) {
    cpu::winograd_conv_backward_weights(x.data<float>(), dy.data<float>(), dw.data<float>(), accumulate,
                                        geometry(s, p));
    if (db.defined()) bias_gradient(dy.data<float>(), s, db.data<float>(), accumulate);
    return;
  }
  const bool lanes = choose_lanes(ConvDirection::BackwardWeights, s, p);
  if (lanes || choose_gemm_weights(s, p)) {
    // Note [Own kernels under --amp]
    const Tensor xr = cpu::rounded_operand(x, p.compute), dyr = cpu::rounded_operand(dy, p.compute);
    if (lanes) {
      cpu::lanes_conv_backward_weights(xr.data<float>(), dyr.data<float>(), dw.data<float>(), kernel_db,
                                       accumulate, geometry(s, p));
    } else {
      cpu::gemm_conv_backward_weights(xr.data<float>(), dyr.data<float>(), dw.data<float>(), kernel_db,
                                      accumulate, geometry(s, p));
    }
    if (separate_bias) bias_gradient(dy.data<float>(), s, db.data<float>(), accumulate);
    return;
  }
  if (separate_bias) {
    ConvEntry& e = cached_entry(ConvDirection::BackwardWeights, s, p, false, accumulate);
    run_entry(e, {x.raw_data(), dy.raw_data()}, {dw.raw_data()});
    return bias_gradient(dy.data<float>(), s, db.data<float>(), accumulate);
  }
  ConvEntry& e = cached_entry(ConvDirection::BackwardWeights, s, p, db.defined(), accumulate);
  if (db.defined()) {
    run_entry(e, {x.raw_data(), dy.raw_data()}, {dw.raw_data(), db.raw_data()});
  } else {
    run_entry(e, {x.raw_data(), dy.raw_data()}, {dw.raw_data()});
  }
}

}  // namespace mtrain::ops
