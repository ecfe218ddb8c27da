#include "models/mixed_precision.h"

#include "core/error.h"
#include "models/conv.h"
#include "models/linear.h"

namespace mtrain::models {

int set_compute_dtype(Module& root, DType compute) {
  if (compute != DType::Float32 && compute != DType::BFloat16 && compute != DType::Float16) {
    throw InvalidArgument(fmt::format("mixed precision: expected float32, bfloat16 or float16, found {}",
                                      dtype_name(compute)));
  }
  int count = 0;
  for (auto& [name, module] : root.named_modules()) {
    if (auto* conv = dynamic_cast<Conv2d*>(module)) {
      conv->set_compute_dtype(compute);
      ++count;
    } else if (auto* linear = dynamic_cast<Linear*>(module)) {
      linear->set_compute_dtype(compute);
      ++count;
    }
  }
  return count;
}

}  // namespace mtrain::models
