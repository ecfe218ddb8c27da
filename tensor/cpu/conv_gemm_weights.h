// Convolution weight gradients as one GEMM, for layers with very few output positions
// (see Note [Weight gradients as a GEMM] in conv_gemm_weights.cpp). conv.cpp chooses
// it; layers never call it.
#pragma once

#include <cstdint>

namespace mtrain::ops::cpu {

// x[n,c,h,w] * w[o,c,kh,kw] -> y[n,o,oh,ow] with the given stride and symmetric padding.
struct GemmConvShape {
  int64_t n, c, h, w, o, kh, kw, oh, ow, stride_h, stride_w, pad_h, pad_w;
};

// Whether the GEMM formulation handles this convolution's weight gradient (and beats
// oneDNN's direct kernel on it).
bool gemm_weights_applies(const GemmConvShape& s);

// dw = sum over the batch of x (*) dy and db = sum of dy (db may be null); with
// accumulate the results are added to what dw and db hold. NCHW / OIHW, contiguous.
void gemm_conv_backward_weights(const float* x, const float* dy, float* dw, float* db,
                                bool accumulate, const GemmConvShape& s);

}  // namespace mtrain::ops::cpu
