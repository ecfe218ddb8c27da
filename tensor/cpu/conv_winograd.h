// 3x3 convolutions as Winograd F(2x2, 3x3) (see Note [Winograd convolution] in
// conv_winograd.cpp). conv.cpp chooses them; layers never call them.
#pragma once

#include "tensor/cpu/conv_geometry.h"

namespace mtrain::ops::cpu {

// Whether forward and backward-data of this convolution run here: 3x3, stride 1,
// padding 1, and the channel counts and map sizes where it measured faster than oneDNN.
bool winograd_applies(const ConvGeometry& s);

// Whether the weight gradient of this convolution runs here.
bool winograd_weights_applies(const ConvGeometry& s);

// y = conv(x, w) + b; b may be null. NCHW / OIHW, contiguous.
void winograd_conv_forward(const float* x, const float* w, const float* b, float* y,
                           const ConvGeometry& s);

// dx = the gradient of conv(x, w) with respect to x, given dy.
void winograd_conv_backward_data(const float* dy, const float* w, float* dx, const ConvGeometry& s);

// dw (+)= the gradient of conv(x, w) with respect to w, given dy (no bias gradient).
void winograd_conv_backward_weights(const float* x, const float* dy, float* dw, bool accumulate,
                                    const ConvGeometry& s);

}  // namespace mtrain::ops::cpu
