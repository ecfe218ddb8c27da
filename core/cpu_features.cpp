#include "core/cpu_features.h"

namespace mtrain {

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

bool cpu_has_x86_64_v3() {
  // The same test as the clones' resolver (MTRAIN_CLONES).
  static const bool has = __builtin_cpu_supports("x86-64-v3");
  return has;
}

}  // namespace mtrain
