#include "models/layout.h"

#include "core/error.h"
#include "tensor/ops.h"

namespace mtrain::models {

namespace {
// One channel, or one pixel per channel: both layouts are the same bytes.
bool same_memory(int64_t channels, int64_t pixels) { return channels == 1 || pixels == 1; }
}  // namespace

Tensor channels_last_copy(const Tensor& nchw) {
  MTRAIN_CHECK(nchw.ndim() == 4, "channels_last_copy: expected [N, C, H, W], found {}", shape_str(nchw.shape()));
  const Shape shape = {nchw.size(0), nchw.size(2), nchw.size(3), nchw.size(1)};
  if (same_memory(nchw.size(1), nchw.size(2) * nchw.size(3))) return nchw.view(shape);
  Tensor out = Tensor::empty(shape, nchw.dtype(), nchw.device());
  ops::to_channels_last(nchw, out);
  return out;
}

Tensor channels_first_copy(const Tensor& nhwc) {
  MTRAIN_CHECK(nhwc.ndim() == 4, "channels_first_copy: expected [N, H, W, C], found {}", shape_str(nhwc.shape()));
  const Shape shape = {nhwc.size(0), nhwc.size(3), nhwc.size(1), nhwc.size(2)};
  if (same_memory(nhwc.size(3), nhwc.size(1) * nhwc.size(2))) return nhwc.view(shape);
  Tensor out = Tensor::empty(shape, nhwc.dtype(), nhwc.device());
  ops::from_channels_last(nhwc, out);
  return out;
}

}  // namespace mtrain::models
