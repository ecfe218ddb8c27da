#include "models/mixed_precision.h"

#include "core/error.h"
#include "models/activation.h"
#include "models/batchnorm.h"
#include "models/conv.h"
#include "models/flatten.h"
#include "models/identity.h"
#include "models/linear.h"
#include "models/pooling.h"
#include "models/residual.h"
#include "models/sequential.h"
#include "models/torchvision_resnet.h"

// Note [Mixed precision]
// ~~~~~~~~~~~~~~~~~~~~~~
// As torch.autocast, only the layers whose cost is their multiplications change precision: every
// Conv2d and Linear rounds its multiplied operands (input, weight, output gradient) to bfloat16 or
// float16 and accumulates in float32 (Note [Reduced-precision compute] in tensor/ops.h). Everything
// else stays float32: the parameters (the "master weights" the optimizer updates, and what
// checkpoints and --save-final write), their gradients, batch norm and its statistics (PyTorch runs
// them in float32 under autocast too), the loss, and by default the activations between layers.
// Keeping the activations float32 is where this differs from autocast, which passes 16-bit outputs
// from one layer to the next: here each layer's 16-bit operands are formed inside the kernel (on
// the CPU, by the same reorder that moves them into oneDNN's blocked layout, so the rounding costs
// no extra pass), which keeps every other kernel single-typed. The cost is that activation memory
// does not halve, and on a GPU every convolution converts its operands and output (a pass over
// each). On a GPU the float32 tensors between layers hold convolution outputs that cuDNN wrote in
// 16 bits (Note [16-bit kernels on the GPU] in tensor/cuda_ops.h), so there they carry the same
// rounding as autocast's.
//
// MTRAIN_SPEEDUPS=amp-activations does what autocast does instead (set_activation_dtype): each
// convolution's output stays in the 16-bit type, and the batch norm, ReLU, pool and residual add
// after it read and write that type (computing in float32, statistics included: Note [16-bit
// activations] in tensor/ops.h), every gradient in its activation's type. The numbers differ
// from the default where a layer's float32 result is now rounded to 16 bits (batch norm, add,
// pool, a convolution's bias add, the input gradients), as autocast's are; the next convolution
// then reads its input as it is, with no conversion. Linear layers still return float32, for
// the loss, and a model must begin with a convolution and end with a Linear.
//
// bfloat16 has float32's exponent range, so gradients neither underflow nor overflow and need no
// loss scaling. float16 has 5 exponent bits: small gradients flush to zero unless the loss is
// scaled up first (Note [Dynamic loss scaling] in trainer/loop/loss_scaler.cpp), which --amp fp16
// turns on by default.

namespace mtrain::models {

int set_compute_dtype(Module& root, DType compute) {
  if (!is_floating(compute)) {
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

namespace {

// The layers that pass a 16-bit input on in its type and return its gradient in it.
bool passes_16bit_on(Module* m) {
  return dynamic_cast<Conv2d*>(m) || dynamic_cast<BatchNorm2d*>(m) || dynamic_cast<ReLU*>(m) ||
         dynamic_cast<MaxPool2d*>(m) || dynamic_cast<AvgPool2d*>(m) || dynamic_cast<AdaptiveAvgPool2d*>(m) ||
         dynamic_cast<Flatten*>(m) || dynamic_cast<Linear*>(m) || dynamic_cast<Identity*>(m) ||
         dynamic_cast<Sequential*>(m) || dynamic_cast<Residual*>(m) || dynamic_cast<ResNetBlock*>(m);
}

}  // namespace

ActivationStorage set_activation_dtype(Module& root, DType storage) {
  if (!is_floating(storage)) {
    throw InvalidArgument(fmt::format("activation storage: expected float32, bfloat16 or float16, found {}",
                                      dtype_name(storage)));
  }
  const auto modules = root.named_modules();
  ActivationStorage done;
  // Check everything before changing anything.
  for (const auto& [name, m] : modules) {
    if (!passes_16bit_on(m)) {
      done.refused = fmt::format("{} ({}) takes float32 activations only", m->type_name(),
                                 name.empty() ? "the model" : name);
      return done;
    }
  }
  // The images come in float32, which only a convolution turns into 16 bits (a residual
  // block would add them to 16-bit ones), and the loss takes the float32 logits of a Linear.
  Module* first = &root;
  Module* last = &root;
  while (dynamic_cast<Sequential*>(first) != nullptr && first->num_children() > 0) first = &first->child(0);
  while (dynamic_cast<Sequential*>(last) != nullptr && last->num_children() > 0) {
    last = &last->child(last->num_children() - 1);
  }
  if (dynamic_cast<Conv2d*>(first) == nullptr) {
    done.refused = fmt::format("the images go to a {} first, not a convolution", first->type_name());
  } else if (dynamic_cast<Linear*>(last) == nullptr) {
    done.refused = fmt::format("the model ends in a {}, not a Linear (the loss takes float32 logits)",
                               last->type_name());
  }
  if (!done.refused.empty()) return done;
  for (const auto& [name, m] : modules) {
    if (auto* conv = dynamic_cast<Conv2d*>(m)) {
      conv->set_activation_dtype(storage);
      ++done.convolutions;
    }
  }
  return done;
}

}  // namespace mtrain::models
