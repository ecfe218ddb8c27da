// The layers' layout changes between [N, C, H, W] and channels-last [N, H, W, C] (Note
// [Channels last] in tensor/ops.h), allocating their result on the input's device. Where
// the two layouts hold the same memory (one channel, or one pixel per channel) the result
// is a view of the input, not a copy.
#pragma once

#include "tensor/tensor.h"

namespace mtrain::models {

Tensor channels_last_copy(const Tensor& nchw);   // [N, C, H, W] -> [N, H, W, C]
Tensor channels_first_copy(const Tensor& nhwc);  // [N, H, W, C] -> [N, C, H, W]

}  // namespace mtrain::models
