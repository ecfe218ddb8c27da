// Matrix multiply and the linear layer, on oneDNN's sgemm (row-major, no primitive
// to create or cache; it parallelises with the OpenMP runtime).
#include <oneapi/dnnl/dnnl.hpp>

#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/dnnl_support.h"
#include "tensor/cpu/mixed_precision.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace cpu {

void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           const float* b, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (ldc == 0) ldc = n;
  MTRAIN_CHECK(ldc >= n, "sgemm: ldc {} is less than n = {}", ldc, n);
  if (k == 0) {
    // An empty sum: c = beta * c. dnnl_sgemm would reject the leading dimension 0 that
    // an [m, 0] operand has, so this case never reaches it.
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    }
    return;
  }
  const int64_t lda = ta ? m : k;
  const int64_t ldb = tb ? k : n;
  const dnnl_status_t status =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  MTRAIN_CHECK(status == dnnl_success, "dnnl_sgemm(m={}, n={}, k={}) failed with status {}", m, n,
               k, static_cast<int>(status));
}

}  // namespace cpu

void cpu::matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& c,
                 float alpha, float beta) {
  cpu::check_float("matmul", "a", a);
  cpu::check_float("matmul", "b", b);
  cpu::check_float("matmul", "c", c);
  cpu::check_ndim("matmul", "a", a, 2);
  cpu::check_ndim("matmul", "b", b, 2);
  const int64_t m = transpose_a ? a.size(1) : a.size(0);
  const int64_t k = transpose_a ? a.size(0) : a.size(1);
  const int64_t kb = transpose_b ? b.size(1) : b.size(0);
  const int64_t n = transpose_b ? b.size(0) : b.size(1);
  MTRAIN_CHECK(k == kb, "matmul: inner dimensions differ: op(a) is [{}, {}], op(b) is [{}, {}] "
               "(a {}, transpose_a={}, b {}, transpose_b={})", m, k, kb, n, shape_str(a.shape()),
               transpose_a, shape_str(b.shape()), transpose_b);
  cpu::check_shape("matmul", "c", c, {m, n});
  cpu::use_configured_threads();
  cpu::sgemm(transpose_a, transpose_b, m, n, k, alpha, a.data<float>(), b.data<float>(), beta,
        c.data<float>());
}

namespace {

// Note [Reduced-precision compute] on the CPU's linear layers: the operands rounded to
// `compute` into float32 copies (cpu::rounded_operand), then sgemm. The products are
// those a 16-bit GEMM with float32 accumulation forms, and linear layers are a small
// share of any model here.
void check_compute(const char* op, DType compute) {
  MTRAIN_CHECK(compute == DType::Float32 || compute == DType::BFloat16 || compute == DType::Float16,
               "{}: no compute type {}", op, dtype_name(compute));
}

}  // namespace

void cpu::linear_forward(const Tensor& x_in, const Tensor& w_in, const Tensor& b, Tensor& y,
                         DType compute) {
  check_compute("linear_forward", compute);
  const Tensor x = cpu::rounded_operand(x_in, compute), w = cpu::rounded_operand(w_in, compute);
  cpu::check_float("linear_forward", "x", x);
  cpu::check_float("linear_forward", "w", w);
  cpu::check_ndim("linear_forward", "x", x, 2);
  cpu::check_ndim("linear_forward", "w", w, 2);
  const int64_t batch = x.size(0), in = x.size(1), out = w.size(0);
  cpu::check_shape("linear_forward", "w", w, {out, in});
  cpu::check_float_shape("linear_forward", "y", y, {batch, out});
  if (b.defined()) cpu::check_float_shape("linear_forward", "b", b, {out});
  cpu::use_configured_threads();
  float* py = y.data<float>();
  float beta = 0.0f;
  if (b.defined()) {
    // Start y at the bias and let the gemm accumulate onto it.
    const float* pb = b.data<float>();
    for (int64_t r = 0; r < batch; ++r) {
      float* row = py + r * out;
#pragma omp simd
      for (int64_t j = 0; j < out; ++j) row[j] = pb[j];
    }
    beta = 1.0f;
  }
  cpu::sgemm(false, true, batch, out, in, 1.0f, x.data<float>(), w.data<float>(), beta, py);
}

void cpu::linear_backward(const Tensor& x_in, const Tensor& w_in, const Tensor& dy_in, Tensor& dx,
                          Tensor& dw, Tensor& db, bool accumulate, DType compute) {
  check_compute("linear_backward", compute);
  const Tensor x = cpu::rounded_operand(x_in, compute), w = cpu::rounded_operand(w_in, compute);
  // db sums the float32 dy; dx and dw multiply the rounded one.
  const Tensor dy = cpu::rounded_operand(dy_in, compute);
  cpu::check_float("linear_backward", "x", x);
  cpu::check_float("linear_backward", "w", w);
  cpu::check_ndim("linear_backward", "x", x, 2);
  cpu::check_ndim("linear_backward", "w", w, 2);
  const int64_t batch = x.size(0), in = x.size(1), out = w.size(0);
  cpu::check_shape("linear_backward", "w", w, {out, in});
  cpu::check_float_shape("linear_backward", "dy", dy, {batch, out});
  cpu::check_float_shape("linear_backward", "dw", dw, {out, in});
  if (dx.defined()) cpu::check_float_shape("linear_backward", "dx", dx, {batch, in});
  if (db.defined()) cpu::check_float_shape("linear_backward", "db", db, {out});
  cpu::use_configured_threads();
  const float* pdy = dy.data<float>();
  if (dx.defined()) {
    cpu::sgemm(false, false, batch, in, out, 1.0f, pdy, w.data<float>(), 0.0f, dx.data<float>());
  }
  if (batch == 0) {
    // Nothing to add; a gemm with k == 0 must still leave dw zeroed when overwriting.
    if (!accumulate) dw.zero_();
  } else {
    cpu::sgemm(true, false, out, in, batch, 1.0f, pdy, x.data<float>(), accumulate ? 1.0f : 0.0f,
          dw.data<float>());
  }
  if (db.defined()) {
    float* pdb = db.data<float>();
    const float* pdy_in = dy_in.data<float>();
    if (!accumulate) db.zero_();
    for (int64_t r = 0; r < batch; ++r) {
      const float* row = pdy_in + r * out;
#pragma omp simd
      for (int64_t j = 0; j < out; ++j) pdb[j] += row[j];
    }
  }
}

}  // namespace mtrain::ops
