// Convolutions through cuDNN's graph (backend) API, the API under PyTorch's cuDNN path
// (cudnn-frontend), beside the legacy API of cudnn_conv.cpp; used when
// NumericsOptions::cudnn_graph_api asks for it (Note [Convolutions on the graph API] in
// cudnn_graph.cpp). CUDA builds only; internal to tensor/cuda/.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <string>

namespace mtrain::cuda {

// One convolution call: x[n,c,h,w] * w[o,c,kh,kw] -> y[n,o,oh,ow], dilation 1, one group,
// every tensor contiguous in `data` (float, bfloat16 or half), computed in float32: NCHW
// (and OIHW), or with channels_last NHWC (and OHWI; Note [Channels last] in tensor/ops.h).
// The output becomes alpha * op + beta * output with alpha 1.
struct GraphConvolution {
  enum class Direction : uint8_t { Forward, BackwardData, BackwardWeights };
  Direction direction = Direction::Forward;
  cudnnDataType_t data = CUDNN_DATA_FLOAT;
  int64_t n = 0, c = 0, h = 0, w = 0, o = 0, kh = 0, kw = 0, oh = 0, ow = 0;
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  float beta = 0.0f;  // 0 overwrites the output, 1 adds to it
  bool channels_last = false;
};

// Runs `conv` on the calling thread's current stream of `device` (made current by the
// caller) with the engine cuDNN's heuristics rate best among those the numerics settings
// allow (timed, with --cudnn-benchmark). The operands are, by direction: (in0, in1, out) =
// (x, w, y) forward, (w, dy, dx) for the data gradient, (x, dy, dw) for the weight
// gradient. Returns false, having queued nothing, when no engine can run it: the caller
// then runs the legacy API, and the answer is kept per shape (with one log line saying
// why), so the search happens once. Throws mtrain::Error when an engine that was planned
// fails for another reason than refusing the call; `context` describes the call.
bool run_graph_convolution(int device, const GraphConvolution& conv, const void* in0,
                           const void* in1, void* out, const std::string& context);

// How many convolutions run_graph_convolution has queued in this process (for tests: a
// fallback to the legacy API is silent to the caller).
int64_t graph_convolutions_run();

// Builds and finalizes the operation descriptor of `conv`, the part of a plan that needs
// no GPU; throws mtrain::Error naming the attribute cuDNN refused. For tests.
void check_graph_operation(const GraphConvolution& conv);

}  // namespace mtrain::cuda
