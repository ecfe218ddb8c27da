// collectives/half_math: the float16/bfloat16 conversions against independent
// references (gloo's float16 converters; rounding in double for bfloat16) over every
// 16-bit pattern and every tie between neighbours, and the reductions built on them.
#include <catch2/catch.hpp>

#include <gloo/types.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "collectives/half_math.h"
#include "core/error.h"
#include "tests/collectives/half_test_values.h"

using namespace mtrain;

namespace {

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
uint32_t to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}
gloo::float16 gloo_half(uint16_t bits) {
  gloo::float16 h;
  h.x = bits;
  return h;
}
bool is_nan16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

}  // namespace

TEST_CASE("float16: every pattern widens like gloo's converter and narrows back to itself") {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = half::float16_to_float(bits);
    if (is_nan16(bits)) {
      REQUIRE(std::isnan(f));
      REQUIRE(is_nan16(half::float_to_float16(f)));
      continue;
    }
    REQUIRE(to_bits(f) == to_bits(gloo::cpu_half2float(gloo_half(bits))));
    REQUIRE(half::float_to_float16(f) == bits);
  }
}

TEST_CASE("float16: halfway values round to the even neighbour, others to the nearest") {
  int ties = 0;
  // Positive finite neighbours h, h + 1 (subnormals included); their midpoint is exact in
  // float32. The last step, 65504 -> infinity, is covered below.
  for (uint16_t h = 0; h < 0x7bffu; ++h) {
    const float lo = half::float16_to_float(h), hi = half::float16_to_float(h + 1);
    const float mid = (lo + hi) / 2;
    const uint16_t even = (h & 1u) ? static_cast<uint16_t>(h + 1) : h;
    REQUIRE(half::float_to_float16(mid) == even);
    REQUIRE(half::float_to_float16(-mid) == (even | 0x8000u));
    REQUIRE(half::float_to_float16(std::nextafter(mid, 0.0f)) == h);
    REQUIRE(half::float_to_float16(std::nextafter(mid, 1e9f)) == h + 1);
    REQUIRE(half::float_to_float16(mid) == gloo::cpu_float2half_rn(mid).x);
    ++ties;
  }
  CHECK(ties == 0x7bff);
  CHECK(half::float_to_float16(65504.0f) == 0x7bffu);
  CHECK(half::float_to_float16(std::nextafter(65520.0f, 0.0f)) == 0x7bffu);
  CHECK(half::float_to_float16(65520.0f) == 0x7c00u);  // the tie goes to the even: infinity
  CHECK(half::float_to_float16(-1e30f) == 0xfc00u);
  CHECK(half::float_to_float16(std::ldexp(1.0f, -25)) == 0x0000u);  // tie with 0
  CHECK(half::float_to_float16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001u);
  CHECK(half::float_to_float16(-0.0f) == 0x8000u);
}

TEST_CASE("float16: narrowing a sweep of float32 patterns agrees with gloo's converter") {
  for (uint64_t b = 0; b <= 0xffffffffull; b += 65521) {  // a prime stride: every exponent
    const float f = from_bits(static_cast<uint32_t>(b));
    if (std::isnan(f)) continue;
    REQUIRE(half::float_to_float16(f) == gloo::cpu_float2half_rn(f).x);
  }
}

TEST_CASE("bfloat16: widening is exact, narrowing rounds to nearest even") {
  const testing::HalfFormat format = testing::half_format(DType::BFloat16);
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = half::bfloat16_to_float(bits);
    REQUIRE(to_bits(f) == h << 16);
    if (!std::isnan(f)) REQUIRE(half::float_to_bfloat16(f) == bits);
  }
  for (uint64_t b = 0; b <= 0xffffffffull; b += 65521) {
    const float f = from_bits(static_cast<uint32_t>(b));
    if (std::isnan(f)) {
      REQUIRE(std::isnan(half::bfloat16_to_float(half::float_to_bfloat16(f))));
      continue;
    }
    if (std::isinf(f) || std::fabs(f) < 1e-37f) continue;  // the reference models normals
    REQUIRE(half::bfloat16_to_float(half::float_to_bfloat16(f)) ==
            static_cast<float>(testing::round_to_format(format, f)));
  }
  CHECK(half::float_to_bfloat16(from_bits(0x3f808000u)) == 0x3f80u);  // tie, down to even
  CHECK(half::float_to_bfloat16(from_bits(0x3f818000u)) == 0x3f82u);  // tie, up to even
  CHECK(half::float_to_bfloat16(from_bits(0x7f7fffffu)) == 0x7f80u);  // past the max: inf
}

TEST_CASE("reductions combine in float32 and round once per combine") {
  const auto f16 = [](float v) { return half::float_to_float16(v); };
  // 2049 is a tie between 2048 and 2050 (spacing 2 above 2048): the even is 2048.
  std::vector<uint16_t> a{f16(2048), f16(1.5f), f16(-3), f16(65504)};
  std::vector<uint16_t> b{f16(1), f16(2.25f), f16(7), f16(32)};
  std::vector<uint16_t> out(4);
  half::reduce_fn(DType::Float16, ReduceOp::Sum)(out.data(), a.data(), b.data(), 4);
  CHECK(half::float16_to_float(out[0]) == 2048.0f);
  CHECK(half::float16_to_float(out[1]) == 3.75f);
  CHECK(half::float16_to_float(out[2]) == 4.0f);
  CHECK(std::isinf(half::float16_to_float(out[3])));  // 65536 > 65504 + half a step
  // Avg uses the sum: the same combine.
  CHECK(half::reduce_fn(DType::Float16, ReduceOp::Avg) == half::reduce_fn(DType::Float16, ReduceOp::Sum));
  half::reduce_fn(DType::Float16, ReduceOp::Max)(out.data(), a.data(), b.data(), 4);
  CHECK(half::float16_to_float(out[2]) == 7.0f);
  CHECK(half::float16_to_float(out[0]) == 2048.0f);
  // In place on the first operand, as gloo and MPI call it.
  half::reduce_fn(DType::Float16, ReduceOp::Min)(a.data(), a.data(), b.data(), 4);
  CHECK(half::float16_to_float(a[0]) == 1.0f);
  CHECK(half::float16_to_float(a[2]) == -3.0f);

  const auto bf = [](float v) { return half::float_to_bfloat16(v); };
  std::vector<uint16_t> x{bf(256), bf(1)}, y{bf(3), bf(-0.25f)}, z(2);
  half::reduce_fn(DType::BFloat16, ReduceOp::Sum)(z.data(), x.data(), y.data(), 2);
  CHECK(half::bfloat16_to_float(z[0]) == 260.0f);  // 259: spacing 2, nearest is 260
  CHECK(half::bfloat16_to_float(z[1]) == 0.75f);

  CHECK_THROWS_AS(half::reduce_fn(DType::Float32, ReduceOp::Sum), InvalidArgument);
  CHECK_THROWS_WITH(half::reduce_fn(DType::Int64, ReduceOp::Max),
                    Catch::Contains("expected a float16 or bfloat16") && Catch::Contains("int64"));
}

TEST_CASE("max and min keep a NaN whichever operand holds it") {
  // Ranks combine in both orders (recursive doubling, MPI), so replicas agree only if
  // the NaN wins from either side.
  for (const DType dtype : {DType::Float16, DType::BFloat16}) {
    const auto make = [&](float v) {
      return dtype == DType::Float16 ? half::float_to_float16(v) : half::float_to_bfloat16(v);
    };
    const auto back = [&](uint16_t v) {
      return dtype == DType::Float16 ? half::float16_to_float(v) : half::bfloat16_to_float(v);
    };
    const uint16_t nan = make(std::numeric_limits<float>::quiet_NaN());
    std::vector<uint16_t> a{nan, make(1)}, b{make(2), nan}, out(2);
    for (const ReduceOp op : {ReduceOp::Max, ReduceOp::Min}) {
      INFO(dtype_name(dtype) << " " << reduce_op_name(op));
      half::reduce_fn(dtype, op)(out.data(), a.data(), b.data(), 2);
      CHECK(std::isnan(back(out[0])));
      CHECK(std::isnan(back(out[1])));
      half::reduce_fn(dtype, op)(out.data(), b.data(), a.data(), 2);
      CHECK(std::isnan(back(out[0])));
      CHECK(std::isnan(back(out[1])));
    }
  }
}

TEST_CASE("divide_in_place divides in float32 and rounds to the tensor's format") {
  Tensor t = Tensor::empty({3}, DType::Float16);
  auto* p = static_cast<uint16_t*>(t.raw_data());
  p[0] = half::float_to_float16(2050.0f);
  p[1] = half::float_to_float16(1.0f);
  p[2] = half::float_to_float16(-7.0f);
  half::divide_in_place(t, 3);
  CHECK(half::float16_to_float(p[0]) == half::float16_to_float(half::float_to_float16(2050.0f / 3)));
  CHECK(half::float16_to_float(p[0]) == 683.5f);  // 683.33.. at spacing 0.5
  CHECK(half::float16_to_float(p[1]) == half::float16_to_float(half::float_to_float16(1.0f / 3)));
  CHECK(p[2] == half::float_to_float16(-7.0f / 3));
  Tensor b = Tensor::empty({1}, DType::BFloat16);
  static_cast<uint16_t*>(b.raw_data())[0] = half::float_to_bfloat16(10.0f);
  half::divide_in_place(b, 4);
  CHECK(half::bfloat16_to_float(static_cast<uint16_t*>(b.raw_data())[0]) == 2.5f);
  CHECK_THROWS_AS(half::divide_in_place(Tensor::zeros({2}), 2), InvalidArgument);
}
