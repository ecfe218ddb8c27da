// HostCopy: a small tensor's values on their way to the host. Made from a GPU tensor, it
// queues a copy into pinned host memory on the current stream, and a mark after it;
// wait() blocks until the stream has passed that mark, not for the work queued after
// it (Note [Loss statistics stay on the device] in models/loss.cpp). Made from a host
// tensor, it is that tensor, ready at once.
#pragma once

#include <memory>

#include "tensor/cuda_devices.h"
#include "tensor/tensor.h"

namespace mtrain {

class HostCopy {
 public:
  HostCopy() = default;  // holds nothing; wait() throws InternalError
  explicit HostCopy(const Tensor& src);

  // The values, on the host; valid until this object is destroyed or reassigned.
  const Tensor& wait() const;

 private:
  Tensor host_;
  std::unique_ptr<GpuMark> copied_;  // null for a host source
};

}  // namespace mtrain
