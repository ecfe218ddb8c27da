#include "tensor/cpu/batch_kernels.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace mtrain::ops::cpu {

float* thread_scratch(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

int threads_for(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), items)));
}

}  // namespace mtrain::ops::cpu
