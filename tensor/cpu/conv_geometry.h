// The geometry of one convolution, as the own CPU kernels (conv_gemm_weights.cpp,
// conv_lanes.cpp, conv_winograd.cpp) receive it from conv.cpp.
#pragma once

#include <cstdint>

namespace mtrain::ops::cpu {

// x[n,c,h,w] * w[o,c,kh,kw] -> y[n,o,oh,ow] with the given stride and symmetric padding.
struct ConvGeometry {
  int64_t n, c, h, w, o, kh, kw, oh, ow, stride_h, stride_w, pad_h, pad_w;
};

}  // namespace mtrain::ops::cpu
