// cuDNN's graph API without a GPU: the operation descriptors of tensor/cuda/cudnn_graph.cpp
// (tensors, convolution, operation; everything before a handle is needed) build and
// finalize for every direction and data type of resnet18's convolutions, and cuDNN's
// refusal reads as an error naming the descriptor. What needs a GPU (the graph, the
// heuristics, the plans) is in test_cuda_conv_matmul.
#include <catch2/catch.hpp>

#include "core/error.h"
#include "tests/support/skip.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/cudnn_graph.h"

using mtrain::cuda::GraphConvolution;

namespace {

GraphConvolution conv(GraphConvolution::Direction d, cudnnDataType_t data, int64_t c, int64_t o,
                      int64_t k, int64_t stride, int64_t pad, int64_t side) {
  GraphConvolution g;
  g.direction = d;
  g.data = data;
  g.n = 8, g.c = c, g.h = side, g.w = side, g.o = o, g.kh = k, g.kw = k;
  g.oh = g.ow = (side + 2 * pad - k) / stride + 1;
  g.stride_h = g.stride_w = stride;
  g.pad_h = g.pad_w = pad;
  return g;
}

}  // namespace

TEST_CASE("graph-API convolution operations build for every direction and data type", "[cudnn_graph]") {
  using D = GraphConvolution::Direction;
  const D direction = GENERATE(D::Forward, D::BackwardData, D::BackwardWeights);
  const cudnnDataType_t data = GENERATE(CUDNN_DATA_FLOAT, CUDNN_DATA_BFLOAT16, CUDNN_DATA_HALF);
  const float beta = GENERATE(0.0f, 1.0f);
  const bool channels_last = GENERATE(false, true);
  CAPTURE(static_cast<int>(direction), static_cast<int>(data), beta, channels_last);
  // resnet18's: the stem, a block's 3x3, a strided 3x3 and its 1x1 shortcut.
  for (GraphConvolution g :
       {conv(direction, data, 1, 64, 3, 1, 1, 28), conv(direction, data, 64, 64, 3, 1, 1, 28),
        conv(direction, data, 64, 128, 3, 2, 1, 28), conv(direction, data, 64, 128, 1, 2, 0, 28)}) {
    g.beta = beta;
    g.channels_last = channels_last;
    CHECK_NOTHROW(mtrain::cuda::check_graph_operation(g));
  }
}

TEST_CASE("a graph-API operation cuDNN refuses is an error naming the descriptor", "[cudnn_graph]") {
  GraphConvolution g = conv(GraphConvolution::Direction::Forward, CUDNN_DATA_FLOAT, 3, 4, 3, 1, 1, 5);
  g.n = 0;  // no operand may have an empty dimension
  CHECK_THROWS_WITH(mtrain::cuda::check_graph_operation(g),
                    Catch::Contains("finalizing the convolution operation descriptor") &&
                        Catch::Contains("CUDNN_STATUS_BAD_PARAM"));
}

#else

TEST_CASE("graph-API convolutions need a build with CUDA", "[cudnn_graph]") {
  mtrain::testing::skip_test_binary("built without CUDA: no cuDNN graph API to describe operations to");
}

#endif
