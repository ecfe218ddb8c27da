// Shared by the CPU kernels that compute in a 16-bit type on float32 kernels (Note
// [Reduced-precision compute] in tensor/ops.h): the linear layers and the own
// convolution kernels (Note [Own kernels under --amp] in conv.cpp).
#pragma once

#include "tensor/tensor.h"

namespace mtrain::ops::cpu {

// `t` itself for Float32; else a new float32 tensor holding `t` rounded to `compute`.
Tensor rounded_operand(const Tensor& t, DType compute);

}  // namespace mtrain::ops::cpu
