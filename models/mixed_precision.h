// Mixed precision (--amp): convolutions and linear layers multiply in a 16-bit type (bfloat16 or
// float16) and accumulate in float32; parameters, gradients, batch norm's arithmetic and the loss
// stay float32, and so do the activations between layers unless set_activation_dtype stores them
// in 16 bits (Note [Mixed precision] in mixed_precision.cpp).
// float16 needs loss scaling (Note [Dynamic loss scaling] in trainer/loop/loss_scaler.cpp).
#pragma once

#include <string>

#include "models/module.h"

namespace mtrain::models {

// Sets the compute type of every Conv2d and Linear in the subtree of `root` (Float32
// turns mixed precision off again) and returns how many layers it set. Call between steps,
// from the thread that drives the model.
int set_compute_dtype(Module& root, DType compute);

// What set_activation_dtype did: how many convolutions now store their outputs in 16 bits,
// or, with none, which layer keeps the model's activations float32.
struct ActivationStorage {
  int convolutions = 0;
  std::string refused;  // "Dropout (features.3) takes float32 activations only"; empty if set
};

// Stores every Conv2d output of `root` in `storage` (BFloat16 or Float16; Float32 undoes it),
// so that the batch norms, ReLUs, pools and residual adds after them run on 16-bit tensors and
// every gradient takes its activation's type (Note [16-bit activations] in tensor/ops.h). Only
// for a model made of layers that pass 16-bit activations on (Conv2d, BatchNorm2d and
// SyncBatchNorm, ReLU, the pools, Flatten, Linear, Identity and the containers of the zoo),
// whose images go to a Conv2d first and whose last layer is a Linear (its outputs stay
// float32, so the loss sees float32 logits); any other model is left unchanged and
// `refused` says why. Call between steps.
ActivationStorage set_activation_dtype(Module& root, DType storage);

}  // namespace mtrain::models
