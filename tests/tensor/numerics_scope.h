// Sets the GPU kernels' numerics (tensor/cuda_ops.h) for one test and restores what was
// there before.
#pragma once

#include "tensor/cuda_ops.h"

namespace mtrain::testing {

class NumericsScope {
 public:
  explicit NumericsScope(const cuda_ops::NumericsOptions& options) : saved_(cuda_ops::numerics()) {
    cuda_ops::set_numerics(options);
  }
  ~NumericsScope() { cuda_ops::set_numerics(saved_); }
  NumericsScope(const NumericsScope&) = delete;
  NumericsScope& operator=(const NumericsScope&) = delete;

 private:
  cuda_ops::NumericsOptions saved_;
};

}  // namespace mtrain::testing
