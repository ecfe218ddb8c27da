// Conversions between float32 and the two 16-bit float formats (IEEE float16 and
// bfloat16), bit-exact and portable: round to nearest, ties to even, as CUDA's
// __float2half_rn / __float2bfloat16 and oneDNN round. NaN stays a quiet NaN; float16
// overflows to infinity and keeps subnormals. Used by the CPU kernels' 16-bit compute
// (Note [Reduced-precision compute] in tensor/ops.h) and by the collectives' 16-bit
// reductions (collectives/half_math.h); tested exhaustively in
// tests/collectives/test_half_math.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mtrain::half {

namespace detail {

inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float bits_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Drops the low `shift` bits of `value`, rounding to nearest with ties to even. A carry
// out of the mantissa lands in the exponent field, which is the right next value.
inline uint32_t shift_right_rounding(uint32_t value, uint32_t shift) {
  const uint32_t kept = value >> shift;
  const uint32_t rest = value & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  return kept + ((rest > halfway || (rest == halfway && (kept & 1u))) ? 1u : 0u);
}

}  // namespace detail

inline float float16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return detail::bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float32.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return detail::bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_float16(float value) {
  const uint32_t bits = detail::float_bits(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN, kept quiet
  // 65520 (halfway between the largest float16, 65504, and 2^16) and above round to
  // infinity.
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
  if (magnitude >= 0x38800000u) {
    // Normal in float16: rebias the exponent (127 -> 15) and round 23 mantissa bits to 10.
    return sign | static_cast<uint16_t>(detail::shift_right_rounding(magnitude - 0x38000000u, 13));
  }
  // Below 2^-14: a float16 subnormal m * 2^-24. 2^-25 and less round to zero (2^-25 is
  // the tie between 0 and the smallest subnormal; zero is even).
  if (magnitude <= 0x33000000u) return sign;
  const uint32_t exponent = magnitude >> 23;  // 102..112 here
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  // value = mantissa * 2^(exponent - 150), so m = mantissa >> (126 - exponent), rounded;
  // m reaching 1024 is the smallest normal's encoding.
  return sign | static_cast<uint16_t>(detail::shift_right_rounding(mantissa, 126u - exponent));
}

inline float bfloat16_to_float(uint16_t bits) { return detail::bits_float(static_cast<uint32_t>(bits) << 16); }

inline uint16_t float_to_bfloat16(float value) {
  const uint32_t bits = detail::float_bits(value);
  // Round to nearest even on the low 16 bits as one addition (shift_right_rounding's
  // rule, without branches, so loops over tensors vectorise). Rounding can carry into
  // the exponent; past the largest finite value that gives infinity, as it should.
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40u;  // kept quiet
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace mtrain::half
