// The float32 factors of ops::batchnorm_update_running, shared by the CPU loop
// (tensor/cpu/batchnorm_channels.cpp) and the GPU kernel (tensor/cuda/batchnorm_channels.cu)
// so that both multiply by the same numbers. Internal to tensor/; .cu files include it.
#pragma once

#include <cstdint>

#include "core/error.h"

namespace mtrain::detail {

struct RunningUpdateFactors {
  float keep;       // 1 - momentum
  float take_mean;  // momentum
  float take_var;   // momentum * count / (count - 1): the unbiased variance's share
};

// Rounded once on the host. InternalError naming `op` unless count > 1.
inline RunningUpdateFactors running_update_factors(const char* op, int64_t count, double momentum) {
  // The unbiased variance divides by count - 1; the layers reject count <= 1 first.
  MTRAIN_CHECK(count > 1, "{}: count must be > 1, found {}", op, count);
  const double unbias = static_cast<double>(count) / static_cast<double>(count - 1);
  return {static_cast<float>(1.0 - momentum), static_cast<float>(momentum),
          static_cast<float>(momentum * unbias)};
}

}  // namespace mtrain::detail
