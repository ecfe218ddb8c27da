#include "collectives/half_math.h"

#include <fmt/format.h>

#include "core/error.h"

// Note [Half-precision reductions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each combine of two elements widens both to float32, combines them in float32 and rounds the
// result back to the 16-bit format to nearest, ties to even (the rounding of CUDA's
// __float2half_rn and of PyTorch's CPU kernels). A float32 sum of two 16-bit values is exact, so
// each combine rounds exactly once, like an addition done natively in the 16-bit format. Across
// ranks the values are rounded after every combine, so a sum over more than two ranks depends on
// the order of the combines, as with every backend that reduces in the tensor's own type (NCCL
// included). avg is the rounded sum divided by the group size in float32, rounded once more. NaN
// stays NaN (quiet), in max and min too, whichever operand it is; float16 overflow becomes
// infinity.

namespace mtrain::half {
namespace {

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
// A NaN on either side wins, so the result does not depend on which rank's value comes
// first (MPI and the recursive-doubling algorithms combine in both orders).
struct Max { float operator()(float a, float b) const { return b != b ? b : (a < b ? b : a); } };
struct Min { float operator()(float a, float b) const { return b != b ? b : (b < a ? b : a); } };

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
