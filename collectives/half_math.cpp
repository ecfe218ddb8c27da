#include "collectives/half_math.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace mtrain::half {
namespace {

uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

float bits_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Drops the low `shift` bits of `value`, rounding to nearest with ties to even. A carry
// out of the mantissa lands in the exponent field, which is the right next value.
uint32_t shift_right_rounding(uint32_t value, uint32_t shift) {
  const uint32_t kept = value >> shift;
  const uint32_t rest = value & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  return kept + ((rest > halfway || (rest == halfway && (kept & 1u))) ? 1u : 0u);
}

struct Float16 {
  static float widen(uint16_t v) { return float16_to_float(v); }
  static uint16_t narrow(float f) { return float_to_float16(f); }
};
struct BFloat16 {
  static float widen(uint16_t v) { return bfloat16_to_float(v); }
  static uint16_t narrow(float f) { return float_to_bfloat16(f); }
};

// std::max / std::min semantics, the same as gloo's and MPI's float32 max and min.
struct Sum { float operator()(float a, float b) const { return a + b; } };
struct Max { float operator()(float a, float b) const { return a < b ? b : a; } };
struct Min { float operator()(float a, float b) const { return b < a ? b : a; } };

template <class Format, class Combine>
void reduce(void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<uint16_t*>(out);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) {
    o[i] = Format::narrow(Combine{}(Format::widen(x[i]), Format::widen(y[i])));
  }
}

template <class Format>
ReduceFn reduce_fn_for(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return &reduce<Format, Sum>;
    case ReduceOp::Max: return &reduce<Format, Max>;
    case ReduceOp::Min: return &reduce<Format, Min>;
  }
  throw InternalError(fmt::format("unhandled reduce op {}", static_cast<int>(op)));
}

template <class Format>
void divide(uint16_t* p, int64_t n, float divisor) {
  for (int64_t i = 0; i < n; ++i) p[i] = Format::narrow(Format::widen(p[i]) / divisor);
}

}  // namespace

float float16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float32.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t float_to_float16(float value) {
  const uint32_t bits = float_bits(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN, kept quiet
  // 65520 (halfway between the largest float16, 65504, and 2^16) and above round to
  // infinity.
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
  if (magnitude >= 0x38800000u) {
    // Normal in float16: rebias the exponent (127 -> 15) and round 23 mantissa bits to 10.
    return sign | static_cast<uint16_t>(shift_right_rounding(magnitude - 0x38000000u, 13));
  }
  // Below 2^-14: a float16 subnormal m * 2^-24. 2^-25 and less round to zero (2^-25 is
  // the tie between 0 and the smallest subnormal; zero is even).
  if (magnitude <= 0x33000000u) return sign;
  const uint32_t exponent = magnitude >> 23;  // 102..112 here
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  // value = mantissa * 2^(exponent - 150), so m = mantissa >> (126 - exponent), rounded;
  // m reaching 1024 is the smallest normal's encoding.
  return sign | static_cast<uint16_t>(shift_right_rounding(mantissa, 126u - exponent));
}

float bfloat16_to_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bfloat16(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  // Rounding can carry into the exponent; past the largest finite value that gives
  // infinity, as it should.
  return static_cast<uint16_t>(shift_right_rounding(bits, 16));
}

ReduceFn reduce_fn(DType dtype, ReduceOp op) {
  if (dtype == DType::Float16) return reduce_fn_for<Float16>(op);
  if (dtype == DType::BFloat16) return reduce_fn_for<BFloat16>(op);
  throw InvalidArgument(fmt::format("16-bit float reduction: expected a float16 or bfloat16 "
                                    "tensor, found {}",
                                    dtype_name(dtype)));
}

void divide_in_place(const Tensor& tensor, int divisor) {
  auto* p = static_cast<uint16_t*>(tensor.raw_data());
  const auto d = static_cast<float>(divisor);
  switch (tensor.dtype()) {
    case DType::Float16: return divide<Float16>(p, tensor.numel(), d);
    case DType::BFloat16: return divide<BFloat16>(p, tensor.numel(), d);
    default:
      throw InvalidArgument(fmt::format("16-bit float division: expected a float16 or bfloat16 "
                                        "tensor, found {}",
                                        dtype_name(tensor.dtype())));
  }
}

}  // namespace mtrain::half
