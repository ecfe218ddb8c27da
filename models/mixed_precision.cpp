#include "models/mixed_precision.h"

#include "core/error.h"
#include "models/conv.h"
#include "models/linear.h"

// Note [Mixed precision]
// ~~~~~~~~~~~~~~~~~~~~~~
// As torch.autocast, only the layers whose cost is their multiplications change precision: every
// Conv2d and Linear rounds its multiplied operands (input, weight, output gradient) to bfloat16 or
// float16 and accumulates in float32 (Note [Reduced-precision compute] in tensor/ops.h). Everything
// else stays float32: the parameters (the "master weights" the optimizer updates, and what
// checkpoints and --save-final write), their gradients, batch norm and its statistics (PyTorch runs
// them in float32 under autocast too), the loss, and the activations between layers. Keeping the
// activations float32 is where this differs from autocast, which passes 16-bit outputs from one
// layer to the next: here each layer's 16-bit operands are formed inside the kernel (on the CPU,
// by the same reorder that moves them into oneDNN's blocked layout, so the rounding costs no extra
// pass), which keeps every other kernel single-typed. The cost is that activation memory does not
// halve. On a GPU the float32 tensors between layers hold convolution outputs that cuDNN wrote in
// 16 bits (Note [16-bit kernels on the GPU] in tensor/cuda_ops.h), so there they carry the same
// rounding as autocast's.
//
// bfloat16 has float32's exponent range, so gradients neither underflow nor overflow and need no
// loss scaling. float16 has 5 exponent bits: small gradients flush to zero unless the loss is
// scaled up first (Note [Dynamic loss scaling] in trainer/loop/loss_scaler.cpp), which --amp fp16
// turns on by default.

namespace mtrain::models {

int set_compute_dtype(Module& root, DType compute) {
  if (compute != DType::Float32 && compute != DType::BFloat16 && compute != DType::Float16) {
    throw InvalidArgument(fmt::format("mixed precision: expected float32, bfloat16 or float16, found {}",
                                      dtype_name(compute)));
  }
  int count = 0;
  for (auto& [name, module] : root.named_modules()) {
    if (auto* conv = dynamic_cast<Conv2d*>(module)) {
      conv->set_compute_dtype(compute);
      ++count;
    } else if (auto* linear = dynamic_cast<Linear*>(module)) {
      linear->set_compute_dtype(compute);
      ++count;
    }
  }
  return count;
}

}  // namespace mtrain::models
