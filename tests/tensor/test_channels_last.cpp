// Channels-last activations on the CPU (Note [Channels last] in tensor/ops.h): the layout
// changes, global average pooling, convolutions (Note [Channels last on the CPU]: the
// NCHW kernels between transposes, so the same bits) and batch norm over the [N*H*W, C]
// view, each against the NCHW op on the same values.
#include <catch2/catch.hpp>

#include "core/error.h"
#include "tensor/ops.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;
using mtrain::testing::require_same_bits;

namespace {

Tensor last(const Tensor& nchw) {
  Tensor t = Tensor::empty({nchw.size(0), nchw.size(2), nchw.size(3), nchw.size(1)});
  ops::to_channels_last(nchw, t);
  return t;
}

Tensor first(const Tensor& nhwc) {
  Tensor t = Tensor::empty({nhwc.size(0), nhwc.size(3), nhwc.size(1), nhwc.size(2)});
  ops::from_channels_last(nhwc, t);
  return t;
}

}  // namespace

TEST_CASE("to_channels_last puts [n, c, h, w] at [n, h, w, c], and back", "[channels_last]") {
  const Tensor x = random_tensor({2, 3, 4, 5}, 1);
  const Tensor y = last(x);
  CHECK(y.shape() == Shape{2, 4, 5, 3});
  for (int64_t n = 0; n < 2; ++n) {
    for (int64_t c = 0; c < 3; ++c) {
      for (int64_t h = 0; h < 4; ++h) {
        for (int64_t w = 0; w < 5; ++w) {
          CHECK(y.data<float>()[((n * 4 + h) * 5 + w) * 3 + c] == x.data<float>()[((n * 3 + c) * 4 + h) * 5 + w]);
        }
      }
    }
  }
  require_same_bits(first(y), x);
  Tensor wrong = Tensor::empty({2, 3, 4, 5});
  CHECK_THROWS_AS(ops::to_channels_last(x, wrong), InternalError);
}

TEST_CASE("channels-last global average pooling averages each channel", "[channels_last]") {
  const Tensor x = random_tensor({3, 4, 5, 7}, 2);
  Tensor y = Tensor::empty({3, 4, 1, 1});
  ops::global_avgpool_forward(x, y);
  Tensor y_last = Tensor::empty({3, 1, 1, 4});
  ops::global_avgpool_forward_channels_last(last(x), y_last);
  // Another order of the same float sums: within a few ulp.
  require_close(y_last.view({3, 4, 1, 1}), y, 1e-6, 1e-6);
  const Tensor dy = random_tensor({3, 4, 1, 1}, 3);
  Tensor dx = Tensor::empty(x.shape());
  ops::global_avgpool_backward(dy, dx);
  Tensor dx_last = Tensor::empty({3, 5, 7, 4});
  ops::global_avgpool_backward_channels_last(dy.view({3, 1, 1, 4}), dx_last);
  // dy is [N, C] either way ([3, 4, 1, 1] and [3, 1, 1, 4] hold the same numbers).
  require_same_bits(first(dx_last), dx);
}

TEST_CASE("channels-last convolutions give the NCHW convolution's bits on the CPU", "[channels_last]") {
  struct Case {
    Shape x, w;
    ops::Conv2dParams p;
    bool bias;
  };
  ops::Conv2dParams strided{2, 2, 1, 1};
  ops::Conv2dParams shortcut{2, 2, 0, 0};
  for (Case k : {Case{{2, 3, 9, 9}, {5, 3, 3, 3}, {1, 1, 1, 1}, true},
                 Case{{3, 4, 12, 13}, {6, 4, 3, 3}, strided, false},
                 Case{{2, 8, 9, 9}, {16, 8, 1, 1}, shortcut, true}}) {
    CAPTURE(shape_str(k.x), shape_str(k.w));
    const Tensor x = random_tensor(k.x, 4), w = random_tensor(k.w, 5);
    const Tensor b = k.bias ? random_tensor({k.w[0]}, 6) : Tensor();
    const Shape y_shape = {k.x[0], k.w[0], ops::conv_out_size(k.x[2], k.w[2], k.p.stride_h, k.p.pad_h),
                           ops::conv_out_size(k.x[3], k.w[3], k.p.stride_w, k.p.pad_w)};
    Tensor y = Tensor::empty(y_shape);
    ops::conv2d_forward(x, w, b, y, k.p);
    ops::Conv2dParams cl = k.p;
    cl.channels_last = true;
    Tensor y_last = Tensor::empty({y_shape[0], y_shape[2], y_shape[3], y_shape[1]});
    ops::conv2d_forward(last(x), w, b, y_last, cl);
    require_same_bits(first(y_last), y);

    const Tensor dy = random_tensor(y_shape, 7);
    Tensor dx = Tensor::empty(k.x), dx_last = Tensor::empty({k.x[0], k.x[2], k.x[3], k.x[1]});
    ops::conv2d_backward_data(dy, w, dx, k.p);
    ops::conv2d_backward_data(last(dy), w, dx_last, cl);
    require_same_bits(first(dx_last), dx);

    for (const bool accumulate : {false, true}) {
      Tensor dw = random_tensor(k.w, 8), db = random_tensor({k.w[0]}, 9);
      Tensor dw_last = dw.clone(), db_last = db.clone();
      ops::conv2d_backward_weights(x, dy, dw, db, k.p, accumulate);
      ops::conv2d_backward_weights(last(x), last(dy), dw_last, db_last, cl, accumulate);
      require_same_bits(dw_last, dw);  // weights stay [O, C, KH, KW]
      require_same_bits(db_last, db);
    }
  }
}

TEST_CASE("batch norm over the [N*H*W, C] view normalises a channels-last batch", "[channels_last]") {
  const Tensor x = random_tensor({4, 3, 5, 6}, 10, -2.0f, 3.0f);
  Tensor mean = Tensor::empty({3}), var = Tensor::empty({3});
  ops::batchnorm_stats(x, mean, var);
  const Tensor rows = last(x).view({4 * 5 * 6, 3});
  Tensor mean_rows = Tensor::empty({3}), var_rows = Tensor::empty({3});
  ops::batchnorm_stats(rows, mean_rows, var_rows);
  require_close(mean_rows, mean, 1e-7, 1e-6);
  require_close(var_rows, var, 1e-7, 1e-6);
  // The elementwise pass is per element and channel: the same bits in either layout.
  const Tensor invstd = random_tensor({3}, 11, 0.5f, 2.0f), gamma = random_tensor({3}, 12);
  const Tensor beta = random_tensor({3}, 13);
  Tensor y = Tensor::empty(x.shape()), y_rows = Tensor::empty(rows.shape());
  ops::batchnorm_apply_relu(x, mean, invstd, gamma, beta, Tensor(), y);
  ops::batchnorm_apply_relu(rows, mean, invstd, gamma, beta, Tensor(), y_rows);
  require_same_bits(first(y_rows.view({4, 5, 6, 3})), y);
}
