// Which memory layout the oneDNN convolutions compute in (see Note [Convolution
// layout] in conv.cpp). Exposed for the kernel benchmark and tests; layers never
// need it.
#pragma once

#include "tensor/tensor.h"

namespace mtrain::ops::cpu {

enum class ConvLayout {
  Plain,    // primitives work directly on NCHW/OIHW tensors, no reorders
  Blocked,  // oneDNN picks its layout (format_tag::any); data is reordered in and out
  Auto,     // per-shape choice (the default)
};

void set_conv_layout(ConvLayout layout);
ConvLayout conv_layout();

// Whether oneDNN has 16-bit convolutions of `compute` for this CPU (Note
// [Reduced-precision compute] in tensor/ops.h); always true for Float32.
bool conv_compute_supported(DType compute);

// Number of convolution primitives created so far (cache misses), for tests that
// check the steady state creates none.
long conv_primitives_created();

}  // namespace mtrain::ops::cpu
