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
}  // namespace ops

#define MTRAIN_OP(RETURN, NAME, PARAMS, ARGS, DEVICE, WITHOUT_CUDA) \
  RETURN ops::NAME PARAMS {                                         \
    if ((DEVICE).is_cuda()) return cuda_ops::NAME ARGS;             \
    return ops::cpu::NAME ARGS;                                     \
  }
#include "tensor/ops.def"
#undef MTRAIN_OP

}  // namespace mtrain
