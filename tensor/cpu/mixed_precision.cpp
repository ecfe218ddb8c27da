// The CPU side of Note [Reduced-precision compute] (tensor/ops.h) and of loss scaling.
#include <cmath>
#include <cstring>
#include <cstdint>
#include <mutex>

#include "tensor/cpu/checks.h"
#include "tensor/cpu/conv_layout.h"
#include "tensor/cpu/threading.h"
#include "tensor/cuda_ops.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

// Round to nearest even on the upper 16 bits; NaN stays a (quiet) NaN.
inline float round_to_bfloat16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    bits |= 0x00400000u;
  } else {
    bits += 0x7fffu + ((bits >> 16) & 1u);
  }
  bits &= 0xffff0000u;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// GCC's _Float16 conversion rounds to nearest even, overflows to infinity and keeps
// subnormals, as the hardware conversions do.
inline float round_to_float16(float v) { return static_cast<float>(static_cast<_Float16>(v)); }

}  // namespace

bool compute_dtype_supported(DType compute, Device device) {
  if (device.is_cuda()) return cuda_ops::compute_dtype_supported(compute, device.index);
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

void convert(const Tensor& src, Tensor& dst) {
  MTRAIN_CHECK(src.defined() && dst.defined() && src.device() == dst.device() && src.numel() == dst.numel(),
               "convert: expected two tensors of equal size on one device, found {} and {}",
               src.defined() ? src.str() : "undefined", dst.defined() ? dst.str() : "undefined");
  if (src.device().is_cuda()) return cuda_ops::convert(src, dst);
  const int64_t n = src.numel();
  const bool narrow = src.dtype() == DType::Float32 && (dst.dtype() == DType::BFloat16 || dst.dtype() == DType::Float16);
  const bool widen = dst.dtype() == DType::Float32 && (src.dtype() == DType::BFloat16 || src.dtype() == DType::Float16);
  MTRAIN_CHECK(narrow || widen, "convert: from {} to {} is not a float32 <-> 16-bit conversion", dtype_name(src.dtype()),
               dtype_name(dst.dtype()));
  cpu::use_configured_threads();
  if (narrow) {
    const float* p = src.data<float>();
    auto* q = static_cast<uint16_t*>(dst.raw_data());
    const bool bf16 = dst.dtype() == DType::BFloat16;
#pragma omp parallel for if (n > cpu::kParallelGrain)
    for (int64_t i = 0; i < n; ++i) {
      const float r = bf16 ? round_to_bfloat16(p[i]) : 0.0f;
      if (bf16) {
        uint32_t bits;
        std::memcpy(&bits, &r, sizeof bits);
        q[i] = static_cast<uint16_t>(bits >> 16);
      } else {
        const _Float16 h = static_cast<_Float16>(p[i]);
        std::memcpy(&q[i], &h, sizeof h);
      }
    }
  } else {
    const auto* p = static_cast<const uint16_t*>(src.raw_data());
    float* q = dst.data<float>();
    const bool bf16 = src.dtype() == DType::BFloat16;
#pragma omp parallel for if (n > cpu::kParallelGrain)
    for (int64_t i = 0; i < n; ++i) {
      if (bf16) {
        const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
        std::memcpy(&q[i], &bits, sizeof bits);
      } else {
        _Float16 h;
        std::memcpy(&h, &p[i], sizeof h);
        q[i] = static_cast<float>(h);
      }
    }
  }
}

bool non_finite_check_and_unscale(const std::vector<Tensor*>& grads, float inv_scale) {
  if (grads.empty()) return false;
  MTRAIN_CHECK(grads[0] != nullptr && grads[0]->defined(),
               "non_finite_check_and_unscale: gradient 0 is undefined");
  if (grads[0]->device().is_cuda()) return cuda_ops::non_finite_check_and_unscale(grads, inv_scale);
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
