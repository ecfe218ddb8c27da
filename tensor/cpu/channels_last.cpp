// Channels-last layout changes and global average pooling on the CPU (Note [Channels
// last] in tensor/ops.h).
#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

// out[b, k, r] = in[b, r, k] for a batch of [rows, cols] matrices.
void transpose_batches(const float* in, float* out, int64_t batches, int64_t rows, int64_t cols) {
  const int64_t matrix = rows * cols;
#pragma omp parallel for if (batches * matrix >= cpu::kParallelGrain)
  for (int64_t b = 0; b < batches; ++b) {
    const float* src = in + b * matrix;
    float* dst = out + b * matrix;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < cols; ++k) dst[k * rows + r] = src[r * cols + k];
    }
  }
}

}  // namespace

void cpu::to_channels_last(const Tensor& x, Tensor& y) {
  cpu::check_float("to_channels_last", "x", x);
  cpu::check_ndim("to_channels_last", "x", x, 4);
  cpu::check_float_shape("to_channels_last", "y", y, {x.size(0), x.size(2), x.size(3), x.size(1)});
  cpu::use_configured_threads();
  transpose_batches(x.data<float>(), y.data<float>(), x.size(0), x.size(1), x.size(2) * x.size(3));
}

void cpu::from_channels_last(const Tensor& x, Tensor& y) {
  cpu::check_float("from_channels_last", "x", x);
  cpu::check_ndim("from_channels_last", "x", x, 4);
  cpu::check_float_shape("from_channels_last", "y", y, {x.size(0), x.size(3), x.size(1), x.size(2)});
  cpu::use_configured_threads();
  transpose_batches(x.data<float>(), y.data<float>(), x.size(0), x.size(1) * x.size(2), x.size(3));
}

void cpu::global_avgpool_forward_channels_last(const Tensor& x, Tensor& y) {
  const char* op = "global_avgpool_forward_channels_last";
  cpu::check_float(op, "x", x);
  cpu::check_ndim(op, "x", x, 4);
  const int64_t n = x.size(0), area = x.size(1) * x.size(2), c = x.size(3);
  cpu::check_float_shape(op, "y", y, {n, 1, 1, c});
  cpu::use_configured_threads();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  // An empty plane averages to 0 (not 0/0).
  const float inv_area = area > 0 ? 1.0f / static_cast<float>(area) : 0.0f;
#pragma omp parallel for if (n * area * c >= cpu::kParallelGrain)
  for (int64_t b = 0; b < n; ++b) {
    float* out = py + b * c;
    for (int64_t k = 0; k < c; ++k) out[k] = 0.0f;
    for (int64_t s = 0; s < area; ++s) {
      const float* row = px + (b * area + s) * c;
      for (int64_t k = 0; k < c; ++k) out[k] += row[k];
    }
    for (int64_t k = 0; k < c; ++k) out[k] *= inv_area;
  }
}

void cpu::global_avgpool_backward_channels_last(const Tensor& dy, Tensor& dx) {
  const char* op = "global_avgpool_backward_channels_last";
  cpu::check_float(op, "dx", dx);
  cpu::check_ndim(op, "dx", dx, 4);
  const int64_t n = dx.size(0), area = dx.size(1) * dx.size(2), c = dx.size(3);
  cpu::check_float_shape(op, "dy", dy, {n, 1, 1, c});
  cpu::use_configured_threads();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  const float inv_area = area > 0 ? 1.0f / static_cast<float>(area) : 0.0f;
#pragma omp parallel for if (n * area * c >= cpu::kParallelGrain)
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t s = 0; s < area; ++s) {
      float* row = pdx + (b * area + s) * c;
      for (int64_t k = 0; k < c; ++k) row[k] = pdy[b * c + k] * inv_area;
    }
  }
}

}  // namespace mtrain::ops
