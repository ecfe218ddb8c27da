#include "tensor/host_copy.h"

#include "core/error.h"

namespace mtrain {

HostCopy::HostCopy(const Tensor& src) {
  MTRAIN_CHECK(src.defined(), "HostCopy of an undefined tensor");
  if (src.device().is_cpu()) {
    host_ = src;
    return;
  }
  host_ = Tensor::empty_pinned(src.shape(), src.dtype());
  host_.copy_(src, /*non_blocking=*/true);
  copied_ = std::make_unique<GpuMark>(src.device().index);
}

const Tensor& HostCopy::wait() const {
  MTRAIN_CHECK(host_.defined(), "HostCopy::wait on an empty HostCopy");
  if (copied_ != nullptr) copied_->wait();
  return host_;
}

}  // namespace mtrain
