// The CPU side of Note [Reduced-precision compute] (tensor/ops.h) and of loss scaling.
#include <cstdint>
#include <mutex>

#include "tensor/cpu/mixed_precision.h"
#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/conv_layout.h"
#include "tensor/cpu/threading.h"
#include "tensor/half_float.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

inline float round_to_bfloat16(float v) { return half::bfloat16_to_float(half::float_to_bfloat16(v)); }
inline float round_to_float16(float v) { return half::float16_to_float(half::float_to_float16(v)); }

}  // namespace

bool cpu::compute_dtype_supported(DType compute, Device) {
  static std::once_flag once;
  static bool bf16 = false, f16 = false;
  std::call_once(once, [] {
    bf16 = cpu::conv_compute_supported(DType::BFloat16);
    f16 = cpu::conv_compute_supported(DType::Float16);
  });
  switch (compute) {
    case DType::Float32: return true;
    case DType::BFloat16: return bf16;
    case DType::Float16: return f16;
    default: return false;
  }
}

void round_to_dtype(const Tensor& x, DType to, Tensor& y) {
  cpu::check_float("round_to_dtype", "x", x);
  cpu::check_float_shape("round_to_dtype", "y", y, x.shape());
  MTRAIN_CHECK(to == DType::BFloat16 || to == DType::Float16,
               "round_to_dtype: cannot round to {}", dtype_name(to));
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  const int64_t n = x.numel();
  if (to == DType::BFloat16) {
#pragma omp parallel for simd if (n > cpu::kParallelGrain)
    for (int64_t i = 0; i < n; ++i) py[i] = round_to_bfloat16(px[i]);
  } else {
#pragma omp parallel for if (n > cpu::kParallelGrain)
    for (int64_t i = 0; i < n; ++i) py[i] = round_to_float16(px[i]);
  }
}

// The dispatch has checked that src and dst are defined, on one device and of one size.
void cpu::convert(const Tensor& src, Tensor& dst) {
  const int64_t n = src.numel();
  const bool narrow = src.dtype() == DType::Float32 && (dst.dtype() == DType::BFloat16 || dst.dtype() == DType::Float16);
  const bool widen = dst.dtype() == DType::Float32 && (src.dtype() == DType::BFloat16 || src.dtype() == DType::Float16);
  MTRAIN_CHECK(narrow || widen, "convert: from {} to {} is not a float32 <-> 16-bit conversion", dtype_name(src.dtype()),
               dtype_name(dst.dtype()));
  cpu::use_configured_threads();
  // One loop per direction and format, so each conversion inlines.
  const auto each = [n](auto&& body) {
#pragma omp parallel for if (n > cpu::kParallelGrain)
    for (int64_t i = 0; i < n; ++i) body(i);
  };
  if (narrow) {
    const float* p = src.data<float>();
    auto* q = static_cast<uint16_t*>(dst.raw_data());
    if (dst.dtype() == DType::BFloat16) {
      each([&](int64_t i) { q[i] = half::float_to_bfloat16(p[i]); });
    } else {
      each([&](int64_t i) { q[i] = half::float_to_float16(p[i]); });
    }
  } else {
    const auto* p = static_cast<const uint16_t*>(src.raw_data());
    float* q = dst.data<float>();
    if (src.dtype() == DType::BFloat16) {
      each([&](int64_t i) { q[i] = half::bfloat16_to_float(p[i]); });
    } else {
      each([&](int64_t i) { q[i] = half::float16_to_float(p[i]); });
    }
  }
}

Tensor cpu::rounded_operand(const Tensor& t, DType compute) {
  if (compute == DType::Float32) return t;
  Tensor r = Tensor::empty(t.shape(), DType::Float32, t.device());
  round_to_dtype(t, compute, r);
  return r;
}

bool cpu::non_finite_check_and_unscale(const std::vector<Tensor*>& grads, float inv_scale) {
  if (grads.empty()) return false;  // the dispatch sends an empty list here
  cpu::use_configured_threads();
  bool found = false;
  for (size_t i = 0; i < grads.size(); ++i) {
    MTRAIN_CHECK(grads[i] != nullptr, "non_finite_check_and_unscale: gradient {} is null", i);
    cpu::check_float("non_finite_check_and_unscale", "grad", *grads[i]);
    float* p = grads[i]->data<float>();
    const int64_t n = grads[i]->numel();
    // x - x is 0 for every finite x and NaN for inf and NaN: one test for both.
    float probe = 0.0f;
#pragma omp parallel for simd reduction(+ : probe) if (n > cpu::kParallelGrain)
    for (int64_t k = 0; k < n; ++k) {
      probe += p[k] - p[k];
      p[k] *= inv_scale;
    }
    if (probe != 0.0f) found = true;
  }
  return found;
}

}  // namespace mtrain::ops
