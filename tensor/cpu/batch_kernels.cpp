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

void reduce_weight_grads(const float* base, size_t stride, int threads, size_t offset,
                         int64_t weights, int64_t outputs, float* dw, float* db, bool accumulate) {
  auto total = [&](int64_t index) {
    double sum = 0.0;
    for (int t = 0; t < threads; ++t) {
      const float* lanes = base + stride * static_cast<size_t>(t) + offset + index * kLanes;
      for (int64_t k = 0; k < kLanes; ++k) sum += lanes[k];
    }
    return static_cast<float>(sum);
  };
  for (int64_t j = 0; j < weights; ++j) dw[j] = (accumulate ? dw[j] : 0.0f) + total(j);
  if (db) {
    for (int64_t o = 0; o < outputs; ++o) db[o] = (accumulate ? db[o] : 0.0f) + total(weights + o);
  }
}

}  // namespace mtrain::ops::cpu
