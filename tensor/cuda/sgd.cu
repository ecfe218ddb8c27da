// torch.optim.SGD's update on the GPU: the counterpart of tensor/cpu/sgd.cpp (Note
// [Kernel dispatch] in tensor/ops.cpp), for one parameter and for all of a model's
// parameters at once.
//
// Note [Multi-tensor SGD]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A ResNet-18 has 62 parameter tensors, most of them small; one launch each costs more
// in launch overhead than the update itself. sgd_step_all follows apex's
// multi_tensor_apply: a kernel argument (TensorTable) carries the pointers and sizes of
// up to kMaxTensors tensors and, for up to kMaxBlocks blocks, which tensor and which
// kChunk-element chunk of it each block updates. The host walks the parameters in order,
// filling tables and launching one whenever its block slots are full, or its tensor
// slots are full and the last tensor is complete (a tensor cut by a full launch is
// carried into the next table as its first entry). The argument stays within the 4 KiB
// that every CUDA version accepts for kernel parameters. Both kernels apply the same
// device function, so sgd_step_all gives exactly sgd_step's bits, and that function
// rounds as the CPU kernel does (Note [Unfused float arithmetic] in launch.cuh).
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_on;
using detail::check_on_shape;
using detail::first_gpu;
using detail::kThreads;

struct SgdHyper {
  float lr, momentum, take, weight_decay;  // take = 1 - dampening
  bool use_momentum, nesterov, first_step;
};

// The formula of tensor/ops.h, element i. buf is nullptr without momentum; on the first
// step it is written before being read, so garbage in it cannot leak in.
__device__ __forceinline__ void sgd_update(float* param, const float* grad, float* buf,
                                           int64_t i, const SgdHyper& h) {
  const float p = param[i];
  const float d = __fadd_rn(grad[i], __fmul_rn(h.weight_decay, p));
  if (!h.use_momentum) {
    param[i] = __fsub_rn(p, __fmul_rn(h.lr, d));
    return;
  }
  const float b = h.first_step ? d : __fadd_rn(__fmul_rn(h.momentum, buf[i]), __fmul_rn(h.take, d));
  buf[i] = b;
  const float step = h.nesterov ? __fadd_rn(d, __fmul_rn(h.momentum, b)) : b;
  param[i] = __fsub_rn(p, __fmul_rn(h.lr, step));
}

__global__ void sgd_kernel(float* param, const float* grad, float* buf, int64_t n, SgdHyper h) {
  for (int64_t i = detail::global_thread_index(); i < n; i += detail::grid_stride()) {
    sgd_update(param, grad, buf, i, h);
  }
}

constexpr int kMaxTensors = 48;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 16384;  // elements per block: 64 per thread

struct TensorTable {
  float* param[kMaxTensors];
  const float* grad[kMaxTensors];
  float* buf[kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t block_chunk[kMaxBlocks];
  uint8_t block_tensor[kMaxBlocks];
};
static_assert(kMaxTensors <= 256, "block_tensor is a uint8_t");
static_assert(sizeof(TensorTable) + sizeof(SgdHyper) <= 4096,
              "kernel arguments must fit CUDA's 4 KiB parameter limit");

__global__ void sgd_multi_tensor_kernel(TensorTable table, SgdHyper h) {
  const int t = table.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = begin + kChunk < table.numel[t] ? begin + kChunk : table.numel[t];
  float* param = table.param[t];
  const float* grad = table.grad[t];
  float* buf = table.buf[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    sgd_update(param, grad, buf, i, h);
  }
}

SgdHyper hyper(const char* op, float lr, float momentum, float dampening, float weight_decay,
               bool nesterov, bool first_step) {
  const bool use_momentum = momentum != 0.0f;
  MTRAIN_CHECK(!nesterov || (use_momentum && dampening == 0.0f),
               "{}: nesterov needs momentum > 0 and zero dampening, got momentum {} dampening {}",
               op, momentum, dampening);
  return {lr, momentum, 1.0f - dampening, weight_decay, use_momentum, nesterov, first_step};
}

}  // namespace

void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
              float dampening, float weight_decay, bool nesterov, bool first_step) {
  const char* op = "sgd_step";
  const Device device = first_gpu(op, "param", param);
  check_on_shape(op, "grad", grad, device, param.shape());
  const SgdHyper h = hyper(op, lr, momentum, dampening, weight_decay, nesterov, first_step);
  if (h.use_momentum) check_on_shape(op, "momentum_buf", momentum_buf, device, param.shape());
  const int64_t n = param.numel();
  if (n == 0) return;
  cuda::DeviceGuard guard(device.index);
  sgd_kernel<<<detail::grid_for(n), kThreads, 0, detail::stream_for(device.index)>>>(
      param.data<float>(), grad.data<float>(),
      h.use_momentum ? momentum_buf.data<float>() : nullptr, n, h);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

void sgd_step_all(const std::vector<ops::SgdParamRef>& params, float lr, float momentum,
                  float dampening, float weight_decay, bool nesterov, bool first_step) {
  const char* op = "sgd_step_all";
  if (params.empty()) return;
  const SgdHyper h = hyper(op, lr, momentum, dampening, weight_decay, nesterov, first_step);
  MTRAIN_CHECK(params[0].param != nullptr, "{}: parameter 0 has no tensor", op);
  const Device device = first_gpu(op, "param 0", *params[0].param);
  // Every argument is checked before anything is queued, so a bad entry leaves all
  // parameters untouched.
  for (size_t i = 0; i < params.size(); ++i) {
    const ops::SgdParamRef& r = params[i];
    MTRAIN_CHECK(r.param != nullptr && r.grad != nullptr, "{}: parameter {} has no {} tensor", op,
                 i, r.param == nullptr ? "param" : "grad");
    check_on(op, "param", *r.param, device);
    MTRAIN_CHECK(r.param->numel() / kChunk < std::numeric_limits<int32_t>::max(),
                 "{}: parameter {} has {} elements, more than the chunk table can index", op, i,
                 r.param->numel());
    check_on_shape(op, "grad", *r.grad, device, r.param->shape());
    if (h.use_momentum) {
      MTRAIN_CHECK(r.momentum_buf != nullptr, "{}: parameter {} has no momentum buffer", op, i);
      check_on_shape(op, "momentum_buf", *r.momentum_buf, device, r.param->shape());
    }
  }

  cuda::DeviceGuard guard(device.index);
  const cudaStream_t stream = detail::stream_for(device.index);
  TensorTable table{};
  int tensors = 0;
  int blocks = 0;
  auto launch = [&] {
    sgd_multi_tensor_kernel<<<blocks, kThreads, 0, stream>>>(table, h);
    MTRAIN_CUDA_CHECK(cudaGetLastError());
    tensors = 0;
    blocks = 0;
  };
  auto add_tensor = [&](const ops::SgdParamRef& r) {
    table.param[tensors] = r.param->data<float>();
    table.grad[tensors] = r.grad->data<float>();
    table.buf[tensors] = h.use_momentum ? r.momentum_buf->data<float>() : nullptr;
    table.numel[tensors] = r.param->numel();
    return tensors++;
  };
  for (const ops::SgdParamRef& r : params) {
    const int64_t n = r.param->numel();
    if (n == 0) continue;
    int slot = add_tensor(r);
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      table.block_tensor[blocks] = static_cast<uint8_t>(slot);
      table.block_chunk[blocks] = static_cast<int32_t>(chunk);
      ++blocks;
      const bool last_chunk = chunk + 1 == chunks;
      if (blocks == kMaxBlocks || (tensors == kMaxTensors && last_chunk)) {
        launch();
        if (!last_chunk) slot = add_tensor(r);  // carried into the next table
      }
    }
  }
  if (blocks > 0) launch();
}

}  // namespace mtrain::cuda_ops
