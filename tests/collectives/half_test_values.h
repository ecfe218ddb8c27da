// Inputs and expected results for float16/bfloat16 reductions across ranks, shared by
// the MPI test and the Gloo collective worker.
//
// A backend may combine the ranks' values in any order, rounding after every combine,
// so an expected value is only well defined when the order cannot change it. Two kinds
// of element achieve that while still forcing a rounding:
//   - even indices, "every rank": all ranks contribute; every sum over fewer than all
//     ranks is exact in the format, and the total lands one binade higher where it
//     needs rounding (always a tie there: this checks ties-to-even).
//   - odd indices, "two ranks": ranks 0 and 1 contribute values of differing exponents
//     and signs, every other rank contributes +0, so the result is round(a + b) in any
//     order (this checks rounding that is not a tie, and float16 overflow to infinity).
// The expected results round with std::nearbyint in double, independent of the code
// under test. Valid for groups of up to 6 ranks.
#pragma once

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <limits>

#include "collectives/half_math.h"
#include "collectives/process_group.h"
#include "tensor/tensor.h"

namespace mtrain::testing {

struct HalfFormat {
  DType dtype;
  int significant_bits;  // 11 for float16, 8 for bfloat16
  int min_exponent;      // frexp exponent of the smallest normal: -13, -125
  double max_finite;
};

inline HalfFormat half_format(DType dtype) {
  if (dtype == DType::Float16) return {dtype, 11, -13, 65504.0};
  return {DType::BFloat16, 8, -125, 3.3895313892515355e38};
}

// x rounded to the format: to nearest, ties to even (the default FP environment).
inline double round_to_format(const HalfFormat& f, double x) {
  if (x == 0 || std::isinf(x)) return x;
  int exponent = 0;
  std::frexp(x, &exponent);
  exponent = std::max(exponent, f.min_exponent);
  const double ulp = std::ldexp(1.0, exponent - f.significant_bits);
  const double rounded = std::nearbyint(x / ulp) * ulp;
  if (std::fabs(rounded) > f.max_finite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return rounded;
}

// Rank `rank`'s input at global element index i; exactly representable in the format.
inline double half_input(const HalfFormat& f, int rank, int size, int64_t i) {
  const int64_t j = i / 2;
  if (i % 2 == 0) {
    const int64_t limit = int64_t{1} << f.significant_bits;  // integers are exact below it
    const int64_t base = limit / std::max(size, 2) + 1;       // size * base > limit
    const int64_t units = base + (rank + j) % size + j % 3;   // the largest rank varies
    const double scale = std::ldexp(1.0, static_cast<int>(j % 7) - 3);
    return (j % 5 == 0 ? -1.0 : 1.0) * static_cast<double>(units) * scale;
  }
  if (rank > 1) return 0.0;
  // p significant bits, exponents a few binades apart, signs mixed; for float16 every
  // 11th pair overflows (2 x about 2^15 > 65504).
  const int64_t top = int64_t{1} << (f.significant_bits - 1);
  const int64_t mantissa = top + (j * 37 + rank * 101) % top;
  int exponent = static_cast<int>((j + 3 * rank) % 5) - 4;
  if (f.dtype == DType::Float16 && j % 11 == 0) exponent = 15 - (f.significant_bits - 1);
  const bool negative = rank == 1 && j % 3 == 1;
  return (negative ? -1.0 : 1.0) * std::ldexp(static_cast<double>(mantissa), exponent);
}

inline double half_expected(const HalfFormat& f, ReduceOp op, int size, int64_t i) {
  double sum = 0, max = half_input(f, 0, size, i), min = max;
  for (int r = 0; r < size; ++r) {
    const double v = half_input(f, r, size, i);
    sum += v;  // exact in double for these inputs
    max = std::max(max, v);
    min = std::min(min, v);
  }
  switch (op) {
    case ReduceOp::Max: return max;
    case ReduceOp::Min: return min;
    case ReduceOp::Sum: return round_to_format(f, sum);
    case ReduceOp::Avg:
      // The rounded sum divided in float32, then rounded (Note [Half-precision reductions]).
      return round_to_format(
          f, static_cast<double>(static_cast<float>(round_to_format(f, sum)) / static_cast<float>(size)));
  }
  return std::numeric_limits<double>::quiet_NaN();
}

inline Tensor half_input_tensor(const HalfFormat& f, int rank, int size, int64_t offset, int64_t n) {
  Tensor t = Tensor::empty({n}, f.dtype);
  auto* bits = static_cast<uint16_t*>(t.raw_data());
  for (int64_t i = 0; i < n; ++i) {
    const auto v = static_cast<float>(half_input(f, rank, size, offset + i));
    bits[i] = f.dtype == DType::Float16 ? half::float_to_float16(v) : half::float_to_bfloat16(v);
  }
  return t;
}

inline double half_element(const HalfFormat& f, const Tensor& t, int64_t i) {
  const uint16_t bits = static_cast<const uint16_t*>(t.raw_data())[i];
  return f.dtype == DType::Float16 ? half::float16_to_float(bits) : half::bfloat16_to_float(bits);
}

// The first element of `t` (global indices offset..) that differs from the expected
// result, or -1.
inline int64_t first_half_mismatch(const HalfFormat& f, const Tensor& t, int64_t offset,
                                   ReduceOp op, int size) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (half_element(f, t, i) != half_expected(f, op, size, offset + i)) return i;
  }
  return -1;
}

}  // namespace mtrain::testing
