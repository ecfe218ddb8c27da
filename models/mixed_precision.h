// Mixed precision (--amp): convolutions and linear layers multiply in a 16-bit type.
//
// Note [Mixed precision]
// ~~~~~~~~~~~~~~~~~~~~~~
// As torch.autocast, only the layers whose cost is their multiplications change
// precision: every Conv2d and Linear rounds its multiplied operands (input, weight,
// output gradient) to bfloat16 or float16 and accumulates in float32 (Note
// [Reduced-precision compute] in tensor/ops.h). Everything else is float32 as before:
// the parameters (the "master weights" the optimizer updates, and what checkpoints and
// --save-final write), their gradients, batch norm and its statistics (PyTorch runs
// them in float32 under autocast too), the loss, and the activations between layers.
// Keeping the activations float32 is where this differs from autocast, which passes
// 16-bit outputs from one layer to the next: here each layer's 16-bit operands are
// formed inside the kernel (on the CPU, by the same reorder that moves them into
// oneDNN's blocked layout, so the rounding costs no extra pass), which keeps every
// other kernel single-typed. The cost is that activation memory does not halve. On a
// GPU the float32 tensors between layers hold convolution outputs that cuDNN wrote in
// 16 bits (Note [16-bit kernels on the GPU] in tensor/cuda_ops.h), so there they carry
// the same rounding as autocast's.
//
// bfloat16 has float32's exponent range, so gradients neither underflow nor overflow
// and need no loss scaling. float16 has 5 exponent bits: small gradients flush to zero
// unless the loss is scaled up first (Note [Dynamic loss scaling] in
// trainer/loop/loss_scaler.h), which --amp fp16 turns on by default.
#pragma once

#include "models/module.h"

namespace mtrain::models {

// Sets the compute type of every Conv2d and Linear in the subtree of `root` (Float32
// turns mixed precision off again) and returns how many layers it set.
int set_compute_dtype(Module& root, DType compute);

}  // namespace mtrain::models
