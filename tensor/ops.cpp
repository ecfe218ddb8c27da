// The public ops:: functions of the op table (tensor/ops.def): each runs its op's CUDA or
// CPU entry.
//
// Note [Kernel dispatch]
// ~~~~~~~~~~~~~~~~~~~~~~
// Layers, the reducer and the optimizer call one kernel API, tensor/ops.h, whatever the
// device, so they have no second code path. Each ops:: function below looks at one
// tensor, the table's `device` column (the first tensor argument, for most ops), and
// runs cuda_ops::NAME when it is on a GPU, ops::cpu::NAME otherwise, before any other
// check: PyTorch's dispatcher, reduced to one `if`. Each entry then checks every argument
// for its own device, so a layer that mixes devices gets an InternalError rather than a
// CPU kernel reading device pointers as host memory. Three ops look at their arguments
// before choosing: convert (a pair split across devices has no side to run on),
// sgd_step_all and non_finite_check_and_unscale (an empty list goes to the CPU entry,
// which does nothing with it).
//
// The definitions are qualified (ops::NAME), so a table line whose parameters drift from
// ops.h's declaration does not compile. Builds without CUDA dispatch the same way; their
// cuda_ops:: entries (tensor/no_cuda.cpp) say that the build has no CUDA.
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cuda_ops.h"
#include "tensor/ops.h"

namespace mtrain {
namespace ops {
namespace {

Device conversion_device(const Tensor& src, const Tensor& dst) {
  MTRAIN_CHECK(src.defined() && dst.defined() && src.device() == dst.device() && src.numel() == dst.numel(),
               "convert: expected two tensors of equal size on one device, found {} and {}",
               src.defined() ? src.str() : "undefined", dst.defined() ? dst.str() : "undefined");
  return src.device();
}

Device first_param_device(const std::vector<SgdParamRef>& params) {
  if (params.empty() || params[0].param == nullptr) return Device::cpu();
  return params[0].param->device();
}

Device first_grad_device(const std::vector<Tensor*>& grads) {
  if (grads.empty()) return Device::cpu();
  MTRAIN_CHECK(grads[0] != nullptr && grads[0]->defined(),
               "non_finite_check_and_unscale: gradient 0 is undefined");
  return grads[0]->device();
}

}  // namespace

ChannelBlock channel_block(const Tensor& src, int64_t src_offset, const Tensor& dst, int64_t dst_offset,
                           int64_t channels) {
  const auto fits = [&] {
    if (!src.defined() || !dst.defined() || src.dtype() != DType::Float32 || dst.dtype() != DType::Float32) return false;
    if (src.device() != dst.device() || src.ndim() < 2 || src.ndim() != dst.ndim()) return false;
    if (src.shape()[0] != dst.shape()[0]) return false;
    for (int d = 2; d < src.ndim(); ++d) {
      if (src.shape()[d] != dst.shape()[d]) return false;
    }
    return channels >= 0 && src_offset >= 0 && dst_offset >= 0 && src_offset + channels <= src.shape()[1] &&
           dst_offset + channels <= dst.shape()[1];
  };
  MTRAIN_CHECK(fits(), "copy_channels: {} channels from {} at {} into {} at {} do not fit", channels,
               src.defined() ? src.str() : "undefined", src_offset, dst.defined() ? dst.str() : "undefined",
               dst_offset);
  int64_t inner = 1;
  for (int d = 2; d < src.ndim(); ++d) inner *= src.shape()[d];
  const size_t plane = static_cast<size_t>(inner) * sizeof(float);
  ChannelBlock b;
  b.batch = src.shape()[0];
  b.bytes = static_cast<size_t>(channels) * plane;
  b.src_begin = static_cast<size_t>(src_offset) * plane;
  b.src_pitch = static_cast<size_t>(src.shape()[1]) * plane;
  b.dst_begin = static_cast<size_t>(dst_offset) * plane;
  b.dst_pitch = static_cast<size_t>(dst.shape()[1]) * plane;
  return b;
}

LayerNormRows layer_norm_rows(const char* op, const Tensor& x, const Tensor& w, const Tensor& mean,
                              const Tensor& rstd) {
  const auto fits = [&] {
    for (const Tensor* t : {&x, &w, &mean, &rstd}) {
      if (!t->defined() || t->dtype() != DType::Float32 || t->device() != x.device()) return false;
    }
    return x.ndim() == 2 && w.shape() == Shape{x.shape()[1]} && mean.shape() == Shape{x.shape()[0]} &&
           rstd.shape() == mean.shape();
  };
  MTRAIN_CHECK(fits(), "{}: expected float32 x [R, C], w [C], mean and rstd [R] on one device, found {}, {}, {}, {}", op,
               x.defined() ? x.str() : "undefined", w.defined() ? w.str() : "undefined",
               mean.defined() ? mean.str() : "undefined", rstd.defined() ? rstd.str() : "undefined");
  return {x.shape()[0], x.shape()[1]};
}

PermutePlan permute_plan(const Tensor& x, const std::vector<int64_t>& perm, const Tensor& y) {
  const auto fits = [&] {
    if (!x.defined() || !y.defined() || x.dtype() != DType::Float32 || y.dtype() != DType::Float32) return false;
    if (x.device() != y.device() || x.ndim() > kMaxPermuteDims || x.ndim() != y.ndim()) return false;
    if (perm.size() != static_cast<size_t>(x.ndim())) return false;
    std::vector<bool> seen(perm.size(), false);
    for (size_t d = 0; d < perm.size(); ++d) {
      if (perm[d] < 0 || perm[d] >= x.ndim() || seen[static_cast<size_t>(perm[d])]) return false;
      seen[static_cast<size_t>(perm[d])] = true;
      if (y.shape()[d] != x.shape()[static_cast<size_t>(perm[d])]) return false;
    }
    return true;
  };
  MTRAIN_CHECK(fits(), "permute: [{}] of {} into {} does not fit", fmt::join(perm, ", "),
               x.defined() ? x.str() : "undefined", y.defined() ? y.str() : "undefined");
  std::vector<int64_t> strides(perm.size(), 1);
  for (size_t d = perm.size(); d-- > 1;) strides[d - 1] = strides[d] * x.shape()[d];
  PermutePlan plan;
  plan.rank = x.ndim();
  plan.count = y.numel();
  for (size_t d = 0; d < perm.size(); ++d) {
    plan.dims[d] = y.shape()[d];
    plan.x_strides[d] = strides[static_cast<size_t>(perm[d])];
  }
  return plan;
}

ChannelPlanes channel_planes(const char* op, const Tensor& x, const Tensor& per_plane) {
  const bool fits = x.defined() && per_plane.defined() && x.dtype() == DType::Float32 &&
                    per_plane.dtype() == DType::Float32 && x.device() == per_plane.device() && x.ndim() >= 2 &&
                    (per_plane.numel() == x.shape()[0] * x.shape()[1] || per_plane.numel() == x.shape()[1]);
  MTRAIN_CHECK(fits,
               "{}: expected x [N, C, ...] and one float32 value per (n, c) or per c on its device, found {} and {}",
               op, x.defined() ? x.str() : "undefined", per_plane.defined() ? per_plane.str() : "undefined");
  ChannelPlanes p;
  p.planes = x.shape()[0] * x.shape()[1];
  p.inner = p.planes == 0 ? 0 : x.numel() / p.planes;
  p.values = per_plane.numel();
  return p;
}

}  // namespace ops

namespace storage16 {

// Note [Ops on 16-bit storage]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The dispatcher's half of Note [16-bit activations] (ops.h). A call whose tensors are all
// float32 (or integer) goes straight to its entry; only a call with a bfloat16 or float16
// tensor comes here. If the entry on that device reads 16 bits itself (kGpu16Bit, and
// convert everywhere) it gets the tensors as they are. Otherwise each 16-bit tensor is
// replaced by a float32 copy (an output's holds its values only for the ops of kReadsOutput,
// the rest write all of it), the float32 entry runs, and each 16-bit output gets its copy
// rounded back. Tensors inside lists (sgd_step_all, non_finite_check_and_unscale) are
// parameters and gradients, always float32, and are not looked at. One list here decides
// which entries read 16 bits, so a GPU kernel taught them only has to be named in it.

// The GPU entries that read and write 16-bit activations themselves.
constexpr std::string_view kGpu16Bit[] = {
    "conv2d_forward",          "conv2d_backward_data",           "conv2d_backward_weights",
    "add",                     "add_",                           "relu_forward",
    "relu_backward",           "batchnorm_stats",                "batchnorm_apply",
    "batchnorm_apply_relu",    "batchnorm_backward_reduce",      "batchnorm_backward_reduce_relu",
    "batchnorm_backward_apply", "batchnorm_backward_apply_relu",
};

// The ops whose output arguments are also inputs (add_ and scale_ update theirs,
// copy_channels keeps the channels it does not copy).
constexpr std::string_view kReadsOutput[] = {"add_", "scale_", "copy_channels"};

template <size_t N>
bool listed(std::string_view op, const std::string_view (&names)[N]) {
  for (const std::string_view name : names) {
    if (name == op) return true;
  }
  return false;
}

bool is_16bit(const Tensor& t) { return t.defined() && is_16bit_float(t.dtype()); }
template <class A>
bool is_16bit(const A&) {
  return false;
}

template <class... A>
bool any_16bit(const A&... args) {
  return (is_16bit(args) || ...);
}

// The tensors of a listed op's first tensor's shape (its activations: Note [16-bit
// activations]) share that tensor's dtype; convolutions are free to mix.
template <class... A>
void check_one_storage_type(std::string_view op, const A&... args) {
  if (op.substr(0, 4) == "conv") return;
  const Tensor* first = nullptr;
  const auto check = [&](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, Tensor>) {
      if (!a.defined()) return;
      if (first == nullptr) {
        first = &a;
      } else if (a.shape() == first->shape()) {
        MTRAIN_CHECK(a.dtype() == first->dtype(),
                     "{}: the activations must share one storage type (Note [16-bit activations]), found {} and {}",
                     op, first->str(), a.str());
      }
    }
  };
  (check(args), ...);
}

// A tensor argument as the float32 entry sees it: `arg` itself, or a float32 copy (of its
// values when the entry reads them) that finish() rounds back into `arg` when the entry
// may have written it.
class Widened {
 public:
  Widened(const Tensor& arg, Tensor* writable, bool read) : arg_(arg), writable_(writable) {
    if (!is_16bit(arg)) return;
    copy_ = Tensor::empty(arg.shape(), DType::Float32, arg.device());
    if (read) ops::convert(arg, copy_);
  }
  Tensor& get() { return copy_.defined() ? copy_ : const_cast<Tensor&>(arg_); }
  void finish() {
    if (copy_.defined() && writable_ != nullptr) ops::convert(copy_, *writable_);
  }

 private:
  const Tensor& arg_;
  Tensor* writable_;
  Tensor copy_;
};

// Any other argument, passed through.
template <class A>
struct Passed {
  A& arg;
  A& get() { return arg; }
  void finish() {}
};

// `reads_outputs`: whether the op reads its output arguments too.
inline Widened hold(Tensor& t, bool reads_outputs) { return Widened(t, &t, reads_outputs); }
inline Widened hold(const Tensor& t, bool) { return Widened(t, nullptr, /*read=*/true); }
template <class A>
Passed<A> hold(A& a, bool) {
  return Passed<A>{a};
}

// Runs `entry` on the arguments (Note [Ops on 16-bit storage]).
template <class Return, class Entry, class... A>
Return run(std::string_view op, bool on_gpu, const Entry& entry, std::tuple<A&...> args) {
  const bool listed_op = listed(op, kGpu16Bit);
  if (listed_op) std::apply([&](const auto&... a) { check_one_storage_type(op, a...); }, args);
  if (op == "convert" || (listed_op && on_gpu)) return std::apply(entry, args);
  const bool reads_outputs = listed(op, kReadsOutput);
  auto held = std::apply([&](auto&... a) { return std::make_tuple(hold(a, reads_outputs)...); }, args);
  const auto finish = [&] { std::apply([](auto&... h) { (h.finish(), ...); }, held); };
  if constexpr (std::is_void_v<Return>) {
    std::apply([&](auto&... h) { entry(h.get()...); }, held);
    finish();
  } else {
    Return result = std::apply([&](auto&... h) { return entry(h.get()...); }, held);
    finish();
    return result;
  }
}

}  // namespace storage16

// Note [Kernel dispatch], then Note [Ops on 16-bit storage] for a call with a 16-bit tensor.
#define MTRAIN_OP(RETURN, NAME, PARAMS, ARGS, DEVICE, WITHOUT_CUDA)                                  \
  RETURN ops::NAME PARAMS {                                                                          \
    const bool on_gpu = (DEVICE).is_cuda();                                                          \
    if (!storage16::any_16bit ARGS) {                                                                \
      if (on_gpu) return cuda_ops::NAME ARGS;                                                        \
      return ops::cpu::NAME ARGS;                                                                    \
    }                                                                                                \
    const auto entry = [on_gpu](auto&... a) -> RETURN {                                              \
      if (on_gpu) return cuda_ops::NAME(a...);                                                       \
      return ops::cpu::NAME(a...);                                                                   \
    };                                                                                               \
    return storage16::run<RETURN>(#NAME, on_gpu, entry, std::forward_as_tuple ARGS);                 \
  }
#include "tensor/ops.def"
#undef MTRAIN_OP

}  // namespace mtrain
