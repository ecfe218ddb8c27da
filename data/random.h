// Portable seeded randomness for data order and synthetic data.
//
// Note [Portable randomness]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// std::mt19937_64's output sequence is fixed by the standard, but the std::*_distribution
// classes are not: libstdc++ and libc++ turn the same engine into different numbers.
// Shuffles and synthetic images must be identical on every machine and every rank (ranks
// derive their shards from the same permutation), so the few distributions needed are
// written out here. What matters is that every rank computes the same order; parity with
// a PyTorch run's order is a separate choice (Permutation::kTorch, torch_randperm).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace mtrain::data {

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  uint64_t next_u64() { return engine_(); }

  // Uniform in [0, bound), bound > 0, without modulo bias (rejection of the short tail).
  uint64_t uniform_below(uint64_t bound) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t x = engine_();
    while (x >= limit) x = engine_();
    return x % bound;
  }

  // Uniform in [0, 1) with 53 random bits.
  double uniform01() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

  // Standard normal by Box-Muller (one value per call; simplicity over speed).
  double normal() {
    const double u1 = 1.0 - uniform01();  // (0, 1]: log(0) is never taken
    const double u2 = uniform01();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::mt19937_64 engine_;
};

// SplitMix64's finaliser: a well-mixed 64-bit function of its input, for draws keyed by
// (seed, epoch, index) rather than taken from a stream.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A permutation of [0, n) by Fisher-Yates, the same for the same (n, seed) everywhere.
inline std::vector<int64_t> random_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  Rng rng(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.uniform_below(static_cast<uint64_t>(i) + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

// Which permutation a shuffling sampler draws (--shuffle-order).
enum class Permutation {
  kMtrain,  // random_permutation above
  kTorch,   // torch_randperm below: PyTorch's DistributedSampler order
};

// "mtrain" -> kMtrain, "torch" -> kTorch; anything else is InvalidArgument naming the choices.
Permutation parse_permutation(const std::string& name);

// torch.randperm(n, generator=g) on the CPU after g.manual_seed(seed), element for element
// (Note [torch.randperm's order] in random.cpp). Throws InvalidArgument for n at or
// beyond PyTorch's small-n limit (2^32 / 20), where PyTorch switches algorithms.
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed);

inline std::vector<int64_t> permutation(Permutation kind, int64_t n, uint64_t seed) {
  return kind == Permutation::kTorch ? torch_randperm(n, seed) : random_permutation(n, seed);
}

}  // namespace mtrain::data
