// Direct convolution forward for single-channel inputs (see Note [Single-channel convolution]
// in conv_direct.cpp). conv.cpp chooses it; layers never call it.
#pragma once

#include <cstdint>

namespace mtrain::ops::cpu {

// x[n,1,h,w] * w[o,1,kh,kw] -> y[n,o,oh,ow], stride 1, symmetric zero padding.
struct DirectConvShape {
  int64_t n, h, w, o, kh, kw, pad_h, pad_w, oh, ow;
};

// Whether the direct kernels handle this convolution (and beat oneDNN on it).
bool direct_conv_applies(int64_t in_channels, int64_t out_channels, int64_t kh, int64_t kw,
                         int64_t stride_h, int64_t stride_w);

// y = conv(x, w) + b; b may be null. All pointers are contiguous NCHW / OIHW.
void direct_conv_forward(const float* x, const float* w, const float* b, float* y,
                         const DirectConvShape& s);

}  // namespace mtrain::ops::cpu
