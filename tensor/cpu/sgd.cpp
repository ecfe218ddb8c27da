// torch.optim.SGD's update (see the formula in tensor/ops.h), for one parameter and for
// all of a model's parameters.
#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {

void cpu::sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr,
                   float momentum, float dampening, float weight_decay, bool nesterov,
                   bool first_step) {
  cpu::check_float("sgd_step", "param", param);
  cpu::check_float_shape("sgd_step", "grad", grad, param.shape());
  const bool use_momentum = momentum != 0.0f;
  if (use_momentum) cpu::check_float_shape("sgd_step", "momentum_buf", momentum_buf, param.shape());
  MTRAIN_CHECK(!nesterov || (use_momentum && dampening == 0.0f),
               "sgd_step: nesterov needs momentum > 0 and zero dampening, got momentum {} "
               "dampening {}", momentum, dampening);
  cpu::use_configured_threads();
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  const int64_t n = param.numel();
  if (!use_momentum) {
#pragma omp parallel for simd if (n >= cpu::kParallelGrain)
    for (int64_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + weight_decay * p[i]);
    return;
  }
  float* buf = momentum_buf.data<float>();
  // PyTorch starts the buffer at the first gradient itself (no dampening applied);
  // the old buffer is not read then, as it may hold garbage.
  const float take = 1.0f - dampening;
#pragma omp parallel for simd if (n >= cpu::kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] + weight_decay * p[i];
    const float b = first_step ? d : momentum * buf[i] + take * d;
    buf[i] = b;
    p[i] -= lr * (nesterov ? d + momentum * b : b);
  }
}

void cpu::sgd_step_all(const std::vector<SgdParamRef>& params, float lr, float momentum,
                       float dampening, float weight_decay, bool nesterov, bool first_step) {
  // One parameter after another: on the CPU a fused pass would not read less memory, and
  // each sgd_step is already spread over the threads.
  for (size_t i = 0; i < params.size(); ++i) {
    const SgdParamRef& r = params[i];
    MTRAIN_CHECK(r.param != nullptr && r.grad != nullptr,
                 "sgd_step_all: parameter {} has no {} tensor", i,
                 r.param == nullptr ? "param" : "grad");
    Tensor no_buf;
    // ops::, not cpu::: each parameter runs on its own device (the GPU entry rejects a list
    // that mixes devices instead).
    ops::sgd_step(*r.param, *r.grad, r.momentum_buf != nullptr ? *r.momentum_buf : no_buf, lr,
                  momentum, dampening, weight_decay, nesterov, first_step);
  }
}

}  // namespace mtrain::ops
