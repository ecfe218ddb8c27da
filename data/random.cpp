#include "data/random.h"

#include <fmt/format.h>

#include <limits>

#include "core/error.h"

namespace mtrain::data {

// Note [torch.randperm's order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch's DistributedSampler shuffles with torch.randperm(N, generator=g) where
// g.manual_seed(seed + epoch). On the CPU that is (aten's randperm_cpu, unchanged from
// 1.13 to 2.x for n < 2^32 / 20): the identity, then for i = 0 .. n-2 swap r[i] with
// r[i + z], z = random() % (n - i), where random() is the next 32-bit output of the
// generator's MT19937, seeded with the low 32 bits of the seed (at::mt19937 uses the
// standard initialisation). std::mt19937 is that engine, its sequence fixed by the C++
// standard, so the order is reproduced exactly; tests/data/test_sampler_torch.cpp
// compares it with real PyTorch. The modulo is biased, as PyTorch's is: parity is the point.
Permutation parse_permutation(const std::string& name) {
  if (name == "mtrain") return Permutation::kMtrain;
  if (name == "torch") return Permutation::kTorch;
  throw InvalidArgument(fmt::format("--shuffle-order: unknown value '{}' (valid: mtrain, torch)", name));
}

std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed) {
  constexpr int64_t kSmallLimit = std::numeric_limits<uint32_t>::max() / 20;
  if (n >= kSmallLimit) {
    throw InvalidArgument(fmt::format("--shuffle-order torch: PyTorch's order is reproduced for fewer than {} "
                                      "items, found a dataset of {}",
                                      kSmallLimit, n));
  }
  std::vector<int64_t> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r[static_cast<size_t>(i)] = i;
  std::mt19937 engine(static_cast<uint32_t>(seed));
  for (int64_t i = 0; i + 1 < n; ++i) {
    const auto z = static_cast<int64_t>(engine() % static_cast<uint64_t>(n - i));
    std::swap(r[static_cast<size_t>(i)], r[static_cast<size_t>(i + z)]);
  }
  return r;
}

}  // namespace mtrain::data
