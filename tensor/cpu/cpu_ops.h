// The CPU entry of every op in tensor/ops.def, declared from that table and defined in
// tensor/cpu/*.cpp; ops:: runs them for CPU tensors (Note [Kernel dispatch] in
// tensor/ops.cpp). Each checks its tensors (tensor/cpu/checks.h) and throws InternalError
// naming the op, the argument and what it found when one is not a CPU tensor of the
// expected dtype and shape. Internal to tensor/.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace mtrain::ops::cpu {

#define MTRAIN_OP(RETURN, NAME, PARAMS, ARGS, DEVICE, WITHOUT_CUDA) RETURN NAME PARAMS;
#include "tensor/ops.def"
#undef MTRAIN_OP

}  // namespace mtrain::ops::cpu
