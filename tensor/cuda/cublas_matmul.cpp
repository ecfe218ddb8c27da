// Matrix multiply and the linear layer on cuBLAS (the GPU side of tensor/cpu/matmul.cpp;
// Note [Kernel dispatch] in tensor/ops.cpp).
//
// Note [Row-major GEMM on cuBLAS]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cuBLAS is column-major; mtrain's tensors are row-major. A row-major [r, c] matrix is,
// byte for byte, the column-major [c, r] matrix of its transpose, so the row-major
// product c = op(a) op(b) is the column-major product c^T = op(b)^T op(a)^T. Each
// GEMM therefore passes b first and a second, keeps each operand's transpose flag,
// swaps m and n, and gives as leading dimension the row length of each row-major matrix.
// No data moves. The 64-bit entry points (cublasGemmEx_64, cublasSgemv_v2_64) take the
// sizes as they are, so no dimension is ever narrowed to int.
//
// TF32 follows cuda_ops::numerics().allow_tf32_matmul through the compute type
// (CUBLAS_COMPUTE_32F_FAST_TF32 vs CUBLAS_COMPUTE_32F); the handles stay in cuBLAS's
// default math mode, in which CUBLAS_COMPUTE_32F never uses TF32. The bias is added in
// full float32 whatever the setting: multiplying by 1 is exact, and rounding the bias to
// TF32's 10-bit mantissa would change it.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "core/error.h"
#include "tensor/cuda/cublas_loader.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/library_handles.h"
#include "tensor/cuda/mixed_precision.h"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_ndim;
using detail::check_on;
using detail::check_on_shape;

// One row-major GEMM: c[m,n] = alpha * op(a) @ op(b) + beta * c, where a has `a_cols`
// columns and b has `b_cols` columns as stored. `context` describes the op and its
// shapes for error messages and is only called on failure.
struct Gemm {
  bool transpose_a = false, transpose_b = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const void* a = nullptr;
  int64_t a_cols = 0;
  const void* b = nullptr;
  int64_t b_cols = 0;
  float beta = 0.0f;
  float* c = nullptr;
  bool allow_tf32 = false;
  // The type of a and b: float32, or a 16-bit type (Note [16-bit kernels on the GPU]);
  // c and the arithmetic are float32 either way.
  cudaDataType ab_type = CUDA_R_32F;
};

cudaDataType cuda_type(DType t) {
  switch (t) {
    case DType::Float32: return CUDA_R_32F;
    case DType::BFloat16: return CUDA_R_16BF;
    case DType::Float16: return CUDA_R_16F;
    default: break;
  }
  MTRAIN_CHECK(false, "linear on the GPU: no compute type {}", dtype_name(t));
  return CUDA_R_32F;
}


template <class Context>
void run_gemm(int device, const Gemm& g, const Context& context) {
  if (g.m == 0 || g.n == 0) return;
  cublasHandle_t handle = cuda::cublas_handle(device);
  if (g.k == 0) {
    // An empty sum leaves c = beta * c; as on the CPU, beta == 0 writes zeros even over
    // NaN. Handled here so that no operand with a zero leading dimension reaches cuBLAS.
    const int64_t count = g.m * g.n;
    if (g.beta == 0.0f) {
      MTRAIN_CUDA_CHECK(cudaMemsetAsync(g.c, 0, static_cast<size_t>(count) * sizeof(float),
                                        cuda::current_stream(device).handle()));
    } else if (g.beta != 1.0f) {
      MTRAIN_CUBLAS_CHECK(cuda::cublas().sscal_64(handle, count, &g.beta, g.c, 1), context());
    }
    return;
  }
  // Column-major view (Note [Row-major GEMM on cuBLAS]): b is the first operand.
  MTRAIN_CUBLAS_CHECK(
      cuda::cublas().gemm_ex_64(handle, g.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                      g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.n, g.m, g.k, &g.alpha, g.b,
                      g.ab_type, std::max<int64_t>(g.b_cols, 1), g.a, g.ab_type,
                      std::max<int64_t>(g.a_cols, 1), &g.beta, g.c, CUDA_R_32F, g.n,
                      g.allow_tf32 && g.ab_type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                              : CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT),
      context());
}

// At least `n` ones on `device`, for rank-1 bias GEMMs and bias-gradient GEMVs. One
// vector per (thread, device, stream), filled on that stream, so every use is ordered
// after its fill, and a vector replaced by a longer one returns to that stream's pool.
// While the stream is captured (Note [Captured steps] in tensor/cuda_graph.h) the fill
// is a node of the graph, queued at every use, so each replay fills what it reads; a
// fill that only a graph holds does not count for work outside it, which fills again.
const float* ones(int device, int64_t n) {
  struct Ones {
    Tensor v;
    bool filled = false;  // by work that ran outside any capture
  };
  thread_local std::map<std::pair<int, cudaStream_t>, Ones> t_ones;
  const cuda::Stream stream = cuda::current_stream(device);
  Ones& o = t_ones[{device, stream.handle()}];
  if (!o.v.defined() || o.v.numel() < n) {
    // Doubling keeps the number of refills logarithmic when the batch size grows.
    const int64_t length = std::max<int64_t>(n, o.v.defined() ? 2 * o.v.numel() : 0);
    o.v = Tensor::empty({length}, DType::Float32, Device::cuda(device));
    o.filled = false;
  }
  const bool capturing = cuda::is_capturing(stream);
  if (capturing || !o.filled) {
    o.v.fill_(1.0f);
    o.filled = !capturing;
  }
  return o.v.data<float>();
}

// y[batch, out] = b broadcast over the rows, exactly (1 * b[j] in float32).
template <class Context>
void broadcast_bias_rows(int device, const Tensor& b, int64_t batch, int64_t out, float* y,
                         const Context& context) {
  Gemm g;
  g.m = batch;
  g.n = out;
  g.k = 1;
  g.a = ones(device, batch);
  g.a_cols = 1;
  g.b = b.data<float>();
  g.b_cols = out;
  g.c = y;
  run_gemm(device, g, context);
}

}  // namespace

void matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& c,
            float alpha, float beta) {
  const char* op = "matmul";
  MTRAIN_CHECK(a.defined() && a.device().is_cuda(), "{}: a must be a GPU tensor, found {}", op,
               a.str());
  const Device device = a.device();
  check_on(op, "a", a, device);
  check_on(op, "b", b, device);
  check_on(op, "c", c, device);
  check_ndim(op, "a", a, 2);
  check_ndim(op, "b", b, 2);
  const int64_t m = transpose_a ? a.size(1) : a.size(0);
  const int64_t k = transpose_a ? a.size(0) : a.size(1);
  const int64_t kb = transpose_b ? b.size(1) : b.size(0);
  const int64_t n = transpose_b ? b.size(0) : b.size(1);
  MTRAIN_CHECK(k == kb, "{}: inner dimensions differ: op(a) is [{}, {}], op(b) is [{}, {}] "
               "(a {}, transpose_a={}, b {}, transpose_b={})", op, m, k, kb, n,
               shape_str(a.shape()), transpose_a, shape_str(b.shape()), transpose_b);
  check_on_shape(op, "c", c, device, {m, n});
  cuda::DeviceGuard guard(device.index);
  Gemm g;
  g.transpose_a = transpose_a;
  g.transpose_b = transpose_b;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = alpha;
  g.a = a.data<float>();
  g.a_cols = a.size(1);
  g.b = b.data<float>();
  g.b_cols = b.size(1);
  g.beta = beta;
  g.c = c.data<float>();
  g.allow_tf32 = numerics().allow_tf32_matmul;
  run_gemm(device.index, g, [&] {
    return fmt::format("computing matmul c {} = {} * op(a {}, transpose={}) @ op(b {}, "
                       "transpose={}) + {} * c",
                       shape_str(c.shape()), alpha, shape_str(a.shape()), transpose_a,
                       shape_str(b.shape()), transpose_b, beta);
  });
}

namespace {

// x [batch, in] and w [out, in] on one GPU: the checks linear_forward and
// linear_backward share.
struct LinearDims {
  Device device;
  int64_t batch, in, out;
};

LinearDims check_linear_inputs(const char* op, const Tensor& x, const Tensor& w) {
  MTRAIN_CHECK(x.defined() && x.device().is_cuda(), "{}: x must be a GPU tensor, found {}", op,
               x.str());
  const Device device = x.device();
  check_on(op, "x", x, device);
  check_on(op, "w", w, device);
  check_ndim(op, "x", x, 2);
  check_ndim(op, "w", w, 2);
  const int64_t batch = x.size(0), in = x.size(1), out = w.size(0);
  check_on_shape(op, "w", w, device, {out, in});
  return {device, batch, in, out};
}

}  // namespace

void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y, DType compute) {
  const char* op = "linear_forward";
  const LinearDims d = check_linear_inputs(op, x, w);
  const Device device = d.device;
  const int64_t batch = d.batch, in = d.in, out = d.out;
  check_on_shape(op, "y", y, device, {batch, out});
  if (b.defined()) check_on_shape(op, "b", b, device, {out});
  cuda::DeviceGuard guard(device.index);
  const auto context = [&] {
    return fmt::format("computing linear_forward y {} = x {} @ w {}^T{}", shape_str(y.shape()),
                       shape_str(x.shape()), shape_str(w.shape()),
                       b.defined() ? fmt::format(" + b {}", shape_str(b.shape())) : "");
  };
  float* py = y.data<float>();
  float beta = 0.0f;
  if (b.defined()) {
    // As on the CPU: start y at the bias and let the product accumulate onto it.
    broadcast_bias_rows(device.index, b, batch, out, py, context);
    beta = 1.0f;
  }
  Tensor x16, w16;
  Gemm g;
  g.transpose_b = true;
  g.m = batch;
  g.n = out;
  g.k = in;
  g.a = detail::compute_operand(x, compute, x16);
  g.a_cols = in;
  g.b = detail::compute_operand(w, compute, w16);
  g.b_cols = in;
  g.ab_type = cuda_type(compute);
  g.beta = beta;
  g.c = py;
  g.allow_tf32 = numerics().allow_tf32_matmul;
  run_gemm(device.index, g, context);
}

void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw,
                     Tensor& db, bool accumulate, DType compute) {
  const char* op = "linear_backward";
  const LinearDims d = check_linear_inputs(op, x, w);
  const Device device = d.device;
  const int64_t batch = d.batch, in = d.in, out = d.out;
  check_on_shape(op, "dy", dy, device, {batch, out});
  check_on_shape(op, "dw", dw, device, {out, in});
  if (dx.defined()) check_on_shape(op, "dx", dx, device, {batch, in});
  if (db.defined()) check_on_shape(op, "db", db, device, {out});
  cuda::DeviceGuard guard(device.index);
  const auto context = [&] {
    return fmt::format("computing linear_backward for x {}, w {}, dy {} (dx {}, db {}, "
                       "accumulate={})",
                       shape_str(x.shape()), shape_str(w.shape()), shape_str(dy.shape()),
                       dx.defined() ? "wanted" : "not wanted",
                       db.defined() ? "wanted" : "not wanted", accumulate);
  };
  const bool tf32 = numerics().allow_tf32_matmul;
  const float grad_beta = accumulate ? 1.0f : 0.0f;
  const cudaDataType ab_type = cuda_type(compute);
  // The multiplied operands in the compute type; db sums the float32 dy.
  Tensor dy16, w16, x16;
  const void* dy_op = detail::compute_operand(dy, compute, dy16);
  if (dx.defined()) {
    // dx[batch, in] = dy[batch, out] @ w[out, in].
    Gemm g;
    g.m = batch;
    g.n = in;
    g.k = out;
    g.a = dy_op;
    g.a_cols = out;
    g.b = detail::compute_operand(w, compute, w16);
    g.b_cols = in;
    g.c = dx.data<float>();
    g.allow_tf32 = tf32;
    g.ab_type = ab_type;
    run_gemm(device.index, g, context);
  }
  // dw[out, in] (+)= dy^T @ x; with batch == 0 the empty sum zeroes dw or leaves it.
  Gemm g;
  g.transpose_a = true;
  g.m = out;
  g.n = in;
  g.k = batch;
  g.a = dy_op;
  g.a_cols = out;
  g.b = detail::compute_operand(x, compute, x16);
  g.b_cols = in;
  g.beta = grad_beta;
  g.c = dw.data<float>();
  g.allow_tf32 = tf32;
  g.ab_type = ab_type;
  run_gemm(device.index, g, context);

  if (db.defined() && out > 0) {
    if (batch == 0) {
      if (!accumulate) db.zero_();
      return;
    }
    // db[out] (+)= sum over rows of dy: column-major dy is [out, batch] with leading
    // dimension out, times a vector of ones.
    const float one = 1.0f;
    MTRAIN_CUBLAS_CHECK(cuda::cublas().sgemv_64(cuda::cublas_handle(device.index), CUBLAS_OP_N, out,
                                          batch, &one, dy.data<float>(), out,
                                          ones(device.index, batch), 1, &grad_beta,
                                          db.data<float>(), 1),
                        context());
  }
}

}  // namespace mtrain::cuda_ops
