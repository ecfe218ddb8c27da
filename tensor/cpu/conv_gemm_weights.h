// Convolution weight gradients as one GEMM, for layers with very few output positions
// (see Note [Weight gradients as a GEMM] in conv_gemm_weights.cpp). conv.cpp chooses
// it; layers never call it.
#pragma once

#include <cstddef>

#include "tensor/cpu/conv_geometry.h"

namespace mtrain::ops::cpu {

// Whether the GEMM formulation handles this convolution's weight gradient (and beats
// oneDNN's direct kernel on it).
bool gemm_weights_applies(const ConvGeometry& s);

// Bytes of input patches (ROWS) built at a time (Note [Weight gradients as a GEMM]).
inline constexpr size_t kRowsBudget = size_t{4} << 20;

// dw = sum over the batch of x (*) dy and db = sum of dy (db may be null); with
// accumulate the results are added to what dw and db hold. NCHW / OIHW, contiguous.
// `rows_budget` bounds the patches held at once (at least one input channel's).
void gemm_conv_backward_weights(const float* x, const float* dy, float* dw, float* db,
                                bool accumulate, const ConvGeometry& s,
                                size_t rows_budget = kRowsBudget);

}  // namespace mtrain::ops::cpu
