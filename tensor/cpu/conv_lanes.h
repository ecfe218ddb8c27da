// Convolution gradients with sixteen images in the vector lanes, for layers with few
// channels (see Note [Images in the vector lanes] in conv_lanes.cpp). conv.cpp chooses
// them; layers never call them.
#pragma once

#include "tensor/cpu/conv_geometry.h"

namespace mtrain::ops::cpu {

// Whether these kernels handle this convolution's gradient with respect to its input,
// or to its weights (and beat oneDNN on it).
bool lanes_backward_data_applies(const ConvGeometry& s);
bool lanes_backward_weights_applies(const ConvGeometry& s);

// dx = the gradient of conv(x, w) with respect to x, given dy. NCHW / OIHW, contiguous.
void lanes_conv_backward_data(const float* dy, const float* w, float* dx, const ConvGeometry& s);

// dw = sum over the batch of x (*) dy and db = sum of dy (db may be null); with
// accumulate the results are added to what dw and db hold.
void lanes_conv_backward_weights(const float* x, const float* dy, float* dw, float* db,
                                 bool accumulate, const ConvGeometry& s);

}  // namespace mtrain::ops::cpu
