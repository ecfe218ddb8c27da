// Mixed precision (--amp): convolutions and linear layers multiply in a 16-bit type (bfloat16 or
// float16) and accumulate in float32; parameters, gradients, batch norm, the loss and the
// activations between layers stay float32 (Note [Mixed precision] in mixed_precision.cpp).
// float16 needs loss scaling (Note [Dynamic loss scaling] in trainer/loop/loss_scaler.cpp).
#pragma once

#include "models/module.h"

namespace mtrain::models {

// Sets the compute type of every Conv2d and Linear in the subtree of `root` (Float32
// turns mixed precision off again) and returns how many layers it set. Call between steps,
// from the thread that drives the model.
int set_compute_dtype(Module& root, DType compute);

}  // namespace mtrain::models
