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

#define MTRAIN_OP(RETURN, NAME, PARAMS, ARGS, DEVICE, WITHOUT_CUDA) \
  RETURN ops::NAME PARAMS {                                         \
    if ((DEVICE).is_cuda()) return cuda_ops::NAME ARGS;             \
    return ops::cpu::NAME ARGS;                                     \
  }
#include "tensor/ops.def"
#undef MTRAIN_OP

}  // namespace mtrain
