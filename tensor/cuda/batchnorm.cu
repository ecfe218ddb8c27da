// Batch-norm kernels on the GPU: the counterparts of tensor/cpu/batchnorm.cpp (Note
// [Separable batch norm] in tensor/ops.h, Note [Kernel dispatch] in tensor/ops.cpp).
//
// Note [Deterministic batch-norm reductions on the GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A channel's sums run over N*H*W elements, millions in a large batch. As on the CPU
// (Note [Batch-norm reductions]) they accumulate in double and the variance is two-pass
// (or one pass over shifted values, Note [One-pass batch-norm statistics]), so nothing
// cancels catastrophically. Unlike the CPU, the two-pass deviations are taken from the
// mean already rounded to float: where a channel's spread is near the float resolution
// of its mean (1e6 and its neighbours) the variance comes out higher by up to (half an
// ulp of the mean)^2. Each channel's elements, flattened in (n, h, w) order, are cut into
// `chunks` equal ranges; one block sums a range into a partial (per-thread double
// sums, then a fixed-order tree), and a second kernel adds a channel's partials in
// chunk order. No atomics: the result is the same on every run and every GPU model
// (the chunking depends on the shape alone), which SyncBatchNorm's equivalence tests
// and reproducible training rely on. Double accumulation costs little here: the
// kernels are bound by memory bandwidth, not arithmetic.
//
// The elementwise halves (apply, backward apply, and their variants fused with a ReLU:
// Note [Fused batch norm] in tensor/ops.h) round as the CPU kernels do (Note [Unfused
// float arithmetic] in tensor/cuda/launch.cuh), from per-channel constants computed with
// the CPU's formulas.
//
// The activations (x, y, dy, dx, residual, dmasked) may be 16-bit, all of one type (Note
// [16-bit activations] in tensor/ops.h); the per-channel tensors stay float32. The
// kernels are templated on the activations' storage type T: each load widens to float (and
// on to double where the sums are double), the arithmetic is the float32 kernels' own, and
// a stored element is rounded once to T. For T = float nothing changes.
//
// The same per-channel reduction sums a convolution's bias gradient from a 16-bit dy
// (detail::channel_sums, for tensor/cuda/cudnn_conv.cpp), without a float32 copy of dy.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/mixed_precision.h"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_on_shape;
using detail::first_gpu;
using detail::kThreads;
using detail::kWarpSize;
using detail::kWarpsPerBlock;
using detail::load_float;
using detail::storage_data;
using detail::store_as;

struct BnGeometry {
  int64_t n, c, area;
  __host__ __device__ int64_t count() const { return n * area; }  // elements per channel
};

// `dtype`: that of the activations (detail::activation_dtype).
BnGeometry bn_geometry(const char* op, const char* name, const Tensor& x, DType dtype) {
  first_gpu(op, name, x, dtype);
  MTRAIN_CHECK(x.ndim() == 4 || x.ndim() == 2, "{}: {} must be [N,C,H,W] or [N,C], found {}", op,
               name, shape_str(x.shape()));
  const int64_t area = x.ndim() == 4 ? x.size(2) * x.size(3) : 1;
  return {x.size(0), x.size(1), area};
}

// Optional per-channel parameter (undefined = the identity value, nullptr here).
const float* optional_param(const char* op, const char* name, const Tensor& t, Device device,
                            int64_t c) {
  if (!t.defined()) return nullptr;
  check_on_shape(op, name, t, device, {c});
  return t.data<float>();
}

// ---- per-channel reductions (Note [Deterministic batch-norm reductions on the GPU]) ----

// Ranges per channel: enough blocks in all to occupy a large GPU (about 1024), but at
// least 4096 elements per block, so that small tensors do not pay for a wide grid.
constexpr int64_t kTargetBlocks = 1024;
constexpr int64_t kMinElementsPerBlock = 16 * kThreads;

int64_t chunks_per_channel(const BnGeometry& g) {
  const int64_t by_size = (g.count() + kMinElementsPerBlock - 1) / kMinElementsPerBlock;
  const int64_t by_grid = kTargetBlocks / g.c > 1 ? kTargetBlocks / g.c : 1;
  const int64_t chunks = by_size < by_grid ? by_size : by_grid;
  return chunks < 1 ? 1 : chunks;
}

// Block b = channel * chunks + chunk sums `term` over its range of the channel into
// partials[s * blocks + b], s < kSums. `Index` is 32-bit when a channel's count fits,
// which makes the per-element division cheap.
template <int kSums, class Index, class Term>
__global__ void bn_partials_kernel(Term term, BnGeometry g, int64_t chunks,
                                        double* partials) {
  __shared__ double shared[kWarpsPerBlock];
  const int64_t block = blockIdx.x;
  const int64_t channel = block / chunks;
  const int64_t chunk = block % chunks;
  const int64_t count = g.count();
  const int64_t per_chunk = (count + chunks - 1) / chunks;
  const int64_t begin = chunk * per_chunk;
  const int64_t end = begin + per_chunk < count ? begin + per_chunk : count;
  double acc[kSums] = {};
  const Index area = static_cast<Index>(g.area);
  for (Index e = static_cast<Index>(begin + threadIdx.x); e < static_cast<Index>(end);
       e += blockDim.x) {
    const int64_t sample = e / area;
    const int64_t offset = (sample * g.c + channel) * g.area + e % area;
    term(offset, channel, acc);
  }
  const int64_t blocks = g.c * chunks;
  for (int s = 0; s < kSums; ++s) {
    const double total = detail::block_sum(acc[s], shared);
    if (threadIdx.x == 0) partials[s * blocks + block] = total;
  }
}

// Note [Batch-norm reductions over rows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An [M, C] input (BatchNorm1d, or a channels-last activation viewed as [N*H*W, C]: Note
// [Channels last] in tensor/ops.h) has each channel's M elements C floats apart, where a
// block of bn_partials_kernel would read one float per cache line. Here a block takes 32
// neighbouring channels (a warp reads 32 neighbours, one line) over a range of rows, its
// kColumnRows thread rows each summing every kColumnRows-th row of the range in order, then
// the rows' sums added in row order: partial[s][channel][chunk], as the other kernel
// leaves them for bn_finish_kernel. Deterministic as that one.
constexpr int kColumnRows = 8;

template <int kSums, class Term>
__global__ void bn_column_partials_kernel(Term term, BnGeometry g, int64_t chunks,
                                          double* partials) {
  __shared__ double shared[kSums][kColumnRows][kWarpSize + 1];
  const int64_t channel = static_cast<int64_t>(blockIdx.x) * kWarpSize + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t per_chunk = (g.n + chunks - 1) / chunks;
  const int64_t begin = chunk * per_chunk;
  const int64_t end = begin + per_chunk < g.n ? begin + per_chunk : g.n;
  double acc[kSums] = {};
  if (channel < g.c) {
    for (int64_t row = begin + threadIdx.y; row < end; row += kColumnRows) {
      term(row * g.c + channel, channel, acc);
    }
  }
  for (int s = 0; s < kSums; ++s) shared[s][threadIdx.y][threadIdx.x] = acc[s];
  __syncthreads();
  if (threadIdx.y != 0 || channel >= g.c) return;
  for (int s = 0; s < kSums; ++s) {
    double total = 0.0;
    for (int j = 0; j < kColumnRows; ++j) total += shared[s][j][threadIdx.x];
    partials[(s * g.c + channel) * chunks + chunk] = total;
  }
}

// Row ranges for bn_column_partials_kernel: about kTargetBlocks blocks in all, at least
// 16 rows per thread row.
int64_t column_chunks(const BnGeometry& g) {
  const int64_t groups = (g.c + kWarpSize - 1) / kWarpSize;
  const int64_t by_size = (g.n + 16 * kColumnRows - 1) / (16 * kColumnRows);
  const int64_t by_grid = std::max<int64_t>(kTargetBlocks / groups, 1);
  return std::clamp<int64_t>(std::min(by_size, by_grid), 1, 65535);
}

// One block per channel adds its partials in a fixed order and hands the sums to `finish`.
template <int kSums, class Finish>
__global__ void bn_finish_kernel(Finish finish, const double* partials, int64_t c,
                                      int64_t chunks) {
  __shared__ double shared[kWarpsPerBlock];
  const int64_t channel = blockIdx.x;
  double sums[kSums];
  for (int s = 0; s < kSums; ++s) {
    const double* row = partials + s * c * chunks + channel * chunks;
    double acc = 0.0;
    for (int64_t j = threadIdx.x; j < chunks; j += blockDim.x) acc += row[j];
    sums[s] = detail::block_sum(acc, shared);
  }
  if (threadIdx.x == 0) finish(channel, sums);
}

// Sums term over every channel of x and calls finish(channel, sums) once per channel.
template <int kSums, class Term, class Finish>
void reduce_channels(Device device, const BnGeometry& g, Term term, Finish finish) {
  if (g.c == 0) return;
  // Rows ([M, C], Note [Batch-norm reductions over rows]) or planes of each channel.
  const bool rows = g.area == 1;
  const int64_t chunks = rows ? column_chunks(g) : chunks_per_channel(g);
  const int64_t blocks = g.c * chunks;
  MTRAIN_CHECK(g.c <= std::numeric_limits<int32_t>::max(),
               "batch norm: {} channels are more than one launch can cover", g.c);
  // Tensor has no float64 dtype: the double partials live in an Int64 tensor's bytes,
  // allocated on (and so ordered by) the current stream.
  Tensor scratch = Tensor::empty({kSums * blocks}, DType::Int64, device);
  double* partials = static_cast<double*>(scratch.raw_data());
  const cudaStream_t stream = detail::stream_for(device.index);
  cuda::DeviceGuard guard(device.index);
  if (rows) {
    const dim3 grid(static_cast<unsigned>((g.c + kWarpSize - 1) / kWarpSize), static_cast<unsigned>(chunks));
    bn_column_partials_kernel<kSums><<<grid, dim3(kWarpSize, kColumnRows), 0, stream>>>(term, g, chunks, partials);
  } else if (g.count() <= std::numeric_limits<uint32_t>::max() - kThreads) {
    bn_partials_kernel<kSums, uint32_t>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(term, g, chunks, partials);
  } else {
    bn_partials_kernel<kSums, uint64_t>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(term, g, chunks, partials);
  }
  MTRAIN_CUDA_CHECK(cudaGetLastError());
  bn_finish_kernel<kSums><<<static_cast<unsigned>(g.c), kThreads, 0, stream>>>(
      finish, partials, g.c, chunks);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class T>
struct SumX {
  const T* x;
  __device__ void operator()(int64_t offset, int64_t, double* acc) const { acc[0] += load_float(x[offset]); }
};

// (x - mean)^2 with the float mean widened (the CPU widens the double mean).
template <class T>
struct SquaredDeviation {
  const T* x;
  const float* mean;
  __device__ void operator()(int64_t offset, int64_t channel, double* acc) const {
    const double d = static_cast<double>(load_float(x[offset])) - static_cast<double>(mean[channel]);
    acc[0] += d * d;
  }
};

// Note [One-pass batch-norm statistics]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With NumericsOptions::batchnorm_one_pass the mean and the variance come from one read
// of x instead of two: the sums of d = x - k and d^2, in double, where the shift k is the
// channel's first element, then mean = k + S1/n and var = S2/n - (S1/n)^2. The shift
// keeps the sums near the spread rather than the magnitude of the values, so the final
// subtraction cancels only where the first element lies far out in its channel: at
// (mean - k)^2 = 1e8 var it loses 8 of double's 16 digits, still more than float keeps.
// The result is as deterministic as the two-pass kernels' (same chunking, fixed order).
template <class T>
struct ShiftedMoments {
  const T* x;
  int64_t area;
  __device__ void operator()(int64_t offset, int64_t channel, double* acc) const {
    const double d =
        static_cast<double>(load_float(x[offset])) - static_cast<double>(load_float(x[channel * area]));
    acc[0] += d;
    acc[1] += d * d;
  }
};

template <class T>
struct StoreMeanVar {
  const T* x;
  int64_t area;
  double count;
  float* mean;
  float* var;
  __device__ void operator()(int64_t channel, const double* sums) const {
    const double shift_mean = sums[0] / count;
    const double v = sums[1] / count - shift_mean * shift_mean;
    mean[channel] = static_cast<float>(static_cast<double>(load_float(x[channel * area])) + shift_mean);
    var[channel] = static_cast<float>(v > 0.0 ? v : 0.0);
  }
};

// The gradient reaching the batch norm's output: dy, or dy through the ReLU whose output
// is y (relu_backward's formula, Note [Fused batch norm] in tensor/ops.h).
template <bool kMask, class T>
__device__ __forceinline__ float output_grad(const T* dy, const T* y, int64_t i) {
  if constexpr (kMask) return load_float(y[i]) > 0.0f ? load_float(dy[i]) : 0.0f;
  return load_float(dy[i]);
}

template <class T, bool kMask>
struct GradientTerms {
  const T* dy;
  const T* y;  // the fused ReLU's output (kMask)
  const T* x;
  const float* mean;
  __device__ void operator()(int64_t offset, int64_t channel, double* acc) const {
    const double g = output_grad<kMask>(dy, y, offset);
    acc[0] += g;
    acc[1] += g * (static_cast<double>(load_float(x[offset])) - static_cast<double>(mean[channel]));
  }
};

// out[channel] = sum / count, rounded to float (mean, then biased variance).
struct StoreAverage {
  float* out;
  double count;
  __device__ void operator()(int64_t channel, const double* sums) const {
    out[channel] = static_cast<float>(sums[0] / count);
  }
};

struct StoreGradientSums {
  float* sum_dy;
  float* sum_dy_xmu;
  __device__ void operator()(int64_t channel, const double* sums) const {
    sum_dy[channel] = static_cast<float>(sums[0]);
    sum_dy_xmu[channel] = static_cast<float>(sums[1]);
  }
};

// A convolution's bias gradient (detail::channel_sums): db[channel] = sum, or db[channel]
// + sum when accumulating, in double, rounded to float once.
struct StoreChannelSum {
  float* db;
  bool accumulate;
  __device__ void operator()(int64_t channel, const double* sums) const {
    db[channel] = static_cast<float>(accumulate ? static_cast<double>(db[channel]) + sums[0] : sums[0]);
  }
};

// ---- elementwise halves ---------------------------------------------------------------

template <class T>
struct ApplyArgs {
  const T* x;
  const float *mean, *invstd, *gamma, *beta;
  const T* residual;
  T* y;
};

// y = x * scale + shift with scale = invstd * gamma, shift = beta - mean * scale, each
// rounded as in tensor/cpu/batchnorm.cpp; then + residual (kResidual) and the ReLU
// (kRelu), rounded as ops::add and relu_forward.
template <class T, class Index, bool kResidual, bool kRelu>
__global__ void bn_apply_kernel(ApplyArgs<T> a, Index total, Index c, Index area) {
  for (Index i = static_cast<Index>(detail::global_thread_index()); i < total;
       i += static_cast<Index>(detail::grid_stride())) {
    const Index ch = (i / area) % c;
    const float scale = __fmul_rn(a.invstd[ch], a.gamma != nullptr ? a.gamma[ch] : 1.0f);
    const float shift =
        __fsub_rn(a.beta != nullptr ? a.beta[ch] : 0.0f, __fmul_rn(a.mean[ch], scale));
    float v = __fadd_rn(__fmul_rn(load_float(a.x[i]), scale), shift);
    if constexpr (kResidual) v = __fadd_rn(v, load_float(a.residual[i]));
    if constexpr (kRelu) v = v > 0.0f ? v : 0.0f;
    a.y[i] = store_as<T>(v);
  }
}

// The CPU's per-channel constants of the backward apply, in [3, C]: scale = gamma *
// invstd, mean_dy = sum_dy / count and proj = invstd^2 * sum_dy_xmu / count (in double).
__global__ void bn_backward_coefficients_kernel(const float* gamma, const float* invstd,
                                                const float* sum_dy, const float* sum_dy_xmu,
                                                double inv_count, int64_t c,
                                                float* coefficients) {
  for (int64_t ch = detail::global_thread_index(); ch < c; ch += detail::grid_stride()) {
    const double is = invstd[ch];
    coefficients[ch] = __fmul_rn(gamma != nullptr ? gamma[ch] : 1.0f, invstd[ch]);
    coefficients[c + ch] = static_cast<float>(sum_dy[ch] * inv_count);
    coefficients[2 * c + ch] = static_cast<float>(is * is * sum_dy_xmu[ch] * inv_count);
  }
}

template <class T>
struct BackwardApplyArgs {
  const T *dy, *y, *x;
  const float *mean, *coefficients;
  T *dx, *dmasked;
};

// dx = scale * (g - mean_dy - (x - mean) * proj), g = output_grad<kMask>; g itself to
// dmasked when kWriteMasked.
template <class T, class Index, bool kMask, bool kWriteMasked>
__global__ void bn_backward_apply_kernel(BackwardApplyArgs<T> a, Index total, Index c, Index area) {
  for (Index i = static_cast<Index>(detail::global_thread_index()); i < total;
       i += static_cast<Index>(detail::grid_stride())) {
    const Index ch = (i / area) % c;
    const float scale = a.coefficients[ch];
    const float mean_dy = a.coefficients[c + ch];
    const float proj = a.coefficients[2 * c + ch];
    const float g = output_grad<kMask>(a.dy, a.y, i);
    const float centered = __fmul_rn(__fsub_rn(load_float(a.x[i]), a.mean[ch]), proj);
    a.dx[i] = store_as<T>(__fmul_rn(scale, __fsub_rn(__fsub_rn(g, mean_dy), centered)));
    if constexpr (kWriteMasked) a.dmasked[i] = store_as<T>(g);  // exact: g is a loaded T
  }
}

// Launches `kernel<Index>(args, total, c, area)` over `total` elements with 32-bit
// indices when they fit (grid_for keeps total + grid stride below 2^32 then).
template <template <class> class Kernel, class Args>
void launch_elementwise(Device device, const BnGeometry& g, const Args& args) {
  const int64_t total = g.n * g.c * g.area;
  if (total == 0) return;
  cuda::DeviceGuard guard(device.index);
  const unsigned grid = detail::grid_for(total);
  const cudaStream_t stream = detail::stream_for(device.index);
  const int64_t max_index = total + static_cast<int64_t>(grid) * kThreads;
  if (max_index <= std::numeric_limits<uint32_t>::max()) {
    Kernel<uint32_t>::launch(grid, stream, args, static_cast<uint32_t>(total),
                             static_cast<uint32_t>(g.c), static_cast<uint32_t>(g.area));
  } else {
    Kernel<uint64_t>::launch(grid, stream, args, static_cast<uint64_t>(total),
                             static_cast<uint64_t>(g.c), static_cast<uint64_t>(g.area));
  }
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

template <class T, bool kResidual, bool kRelu>
struct Apply {
  template <class Index>
  struct Kernel {
    static void launch(unsigned grid, cudaStream_t stream, const ApplyArgs<T>& a, Index total,
                       Index c, Index area) {
      bn_apply_kernel<T, Index, kResidual, kRelu><<<grid, kThreads, 0, stream>>>(a, total, c, area);
    }
  };
};

template <class T, bool kMask, bool kWriteMasked>
struct BackwardApply {
  template <class Index>
  struct Kernel {
    static void launch(unsigned grid, cudaStream_t stream, const BackwardApplyArgs<T>& a,
                       Index total, Index c, Index area) {
      bn_backward_apply_kernel<T, Index, kMask, kWriteMasked>
          <<<grid, kThreads, 0, stream>>>(a, total, c, area);
    }
  };
};

// The checks every apply shares (residual may be undefined); returns x's geometry.
BnGeometry check_apply(const char* op, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                       const Tensor& y, const Tensor& residual = Tensor()) {
  const DType t = detail::activation_dtype(op, {{"x", &x}, {"y", &y}, {"residual", &residual}});
  const BnGeometry g = bn_geometry(op, "x", x, t);
  const Device device = x.device();
  check_on_shape(op, "mean", mean, device, {g.c});
  check_on_shape(op, "invstd", invstd, device, {g.c});
  check_on_shape(op, "y", y, device, x.shape(), t);
  if (residual.defined()) check_on_shape(op, "residual", residual, device, x.shape(), t);
  return g;
}

template <class T>
ApplyArgs<T> apply_args(const char* op, const BnGeometry& g, const Tensor& x, const Tensor& mean,
                        const Tensor& invstd, const Tensor& gamma, const Tensor& beta, Tensor& y) {
  const Device device = x.device();
  return {storage_data<T>(x),
          mean.data<float>(),
          invstd.data<float>(),
          optional_param(op, "gamma", gamma, device, g.c),
          optional_param(op, "beta", beta, device, g.c),
          nullptr,
          storage_data<T>(y)};
}

// Checks a backward reduce's tensors (dy first: it sets the device; y, the fused ReLU's
// output, may be undefined); returns x's geometry.
BnGeometry check_reduce(const char* op, const Tensor& dy, const Tensor& x, const Tensor& mean,
                        const Tensor& sum_dy, const Tensor& sum_dy_xmu, const Tensor& y = Tensor()) {
  const DType t = detail::activation_dtype(op, {{"dy", &dy}, {"x", &x}, {"y", &y}});
  const Device device = first_gpu(op, "dy", dy, t);
  const BnGeometry g = bn_geometry(op, "x", x, t);
  check_on_shape(op, "x", x, device, dy.shape(), t);
  if (y.defined()) check_on_shape(op, "y", y, device, x.shape(), t);
  check_on_shape(op, "mean", mean, device, {g.c});
  check_on_shape(op, "sum_dy", sum_dy, device, {g.c});
  check_on_shape(op, "sum_dy_xmu", sum_dy_xmu, device, {g.c});
  return g;
}

// Checks a backward apply's tensors (y and dmasked, of the fused variant, may be
// undefined), queues the per-channel coefficients and gathers the elementwise pass's
// arguments in storage type T (that of the activations, already checked to be one);
// `coefficients` keeps them.
template <class T>
BackwardApplyArgs<T> backward_apply_args(const char* op, const Tensor& dy, const Tensor& x,
                                         const Tensor& mean, const Tensor& invstd,
                                         const Tensor& gamma, const Tensor& sum_dy,
                                         const Tensor& sum_dy_xmu, double count, Tensor& dx,
                                         const Tensor& y, const Tensor& dmasked, BnGeometry& g,
                                         Tensor& coefficients) {
  const DType t = detail::StorageDType<T>::value;
  const Device device = first_gpu(op, "dy", dy, t);
  g = bn_geometry(op, "x", x, t);
  check_on_shape(op, "x", x, device, dy.shape(), t);
  check_on_shape(op, "mean", mean, device, {g.c});
  check_on_shape(op, "invstd", invstd, device, {g.c});
  check_on_shape(op, "sum_dy", sum_dy, device, {g.c});
  check_on_shape(op, "sum_dy_xmu", sum_dy_xmu, device, {g.c});
  check_on_shape(op, "dx", dx, device, x.shape(), t);
  if (y.defined()) check_on_shape(op, "y", y, device, x.shape(), t);
  if (dmasked.defined()) check_on_shape(op, "dmasked", dmasked, device, x.shape(), t);
  MTRAIN_CHECK(count >= 0.0, "{}: count must be >= 0, got {}", op, count);
  const float* pg = optional_param(op, "gamma", gamma, device, g.c);
  BackwardApplyArgs<T> a{storage_data<T>(dy),
                         y.defined() ? storage_data<T>(y) : nullptr,
                         storage_data<T>(x),
                         mean.data<float>(),
                         nullptr,
                         storage_data<T>(dx),
                         dmasked.defined() ? storage_data<T>(dmasked) : nullptr};
  if (x.numel() == 0) return a;
  // With no elements anywhere the reductions are empty: their means are 0, not 0/0.
  const double inv_count = count > 0.0 ? 1.0 / count : 0.0;
  coefficients = Tensor::empty({3, g.c}, DType::Float32, device);
  a.coefficients = coefficients.data<float>();
  cuda::DeviceGuard guard(device.index);
  bn_backward_coefficients_kernel<<<detail::grid_for(g.c), kThreads, 0,
                                    detail::stream_for(device.index)>>>(
      pg, invstd.data<float>(), sum_dy.data<float>(), sum_dy_xmu.data<float>(), inv_count, g.c,
      coefficients.data<float>());
  MTRAIN_CUDA_CHECK(cudaGetLastError());
  return a;
}

}  // namespace

// Each entry checks its tensors, then runs with T the storage type of the activations
// (detail::with_storage).

void batchnorm_stats(const Tensor& x, Tensor& mean, Tensor& var) {
  const char* op = "batchnorm_stats";
  const BnGeometry g = bn_geometry(op, "x", x, detail::activation_dtype(op, {{"x", &x}}));
  const Device device = x.device();
  check_on_shape(op, "mean", mean, device, {g.c});
  check_on_shape(op, "var", var, device, {g.c});
  if (g.c == 0) return;
  if (g.count() == 0) {
    // With no elements both are 0, not 0/0 (as on the CPU).
    mean.zero_();
    var.zero_();
    return;
  }
  const double count = static_cast<double>(g.count());
  detail::with_storage(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = storage_data<T>(x);
    if (numerics().batchnorm_one_pass) {
      reduce_channels<2>(device, g, ShiftedMoments<T>{px, g.area},
                         StoreMeanVar<T>{px, g.area, count, mean.data<float>(), var.data<float>()});
      return;
    }
    reduce_channels<1>(device, g, SumX<T>{px}, StoreAverage{mean.data<float>(), count});
    reduce_channels<1>(device, g, SquaredDeviation<T>{px, mean.data<float>()},
                       StoreAverage{var.data<float>(), count});
  });
}

void batchnorm_apply(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                     const Tensor& gamma, const Tensor& beta, Tensor& y) {
  const char* op = "batchnorm_apply";
  const BnGeometry g = check_apply(op, x, mean, invstd, y);
  detail::with_storage(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const ApplyArgs<T> a = apply_args<T>(op, g, x, mean, invstd, gamma, beta, y);
    launch_elementwise<Apply<T, false, false>::template Kernel>(x.device(), g, a);
  });
}

void batchnorm_apply_relu(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                          const Tensor& gamma, const Tensor& beta, const Tensor& residual,
                          Tensor& y) {
  const char* op = "batchnorm_apply_relu";
  const BnGeometry g = check_apply(op, x, mean, invstd, y, residual);
  detail::with_storage(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    ApplyArgs<T> a = apply_args<T>(op, g, x, mean, invstd, gamma, beta, y);
    if (residual.defined()) {
      a.residual = storage_data<T>(residual);
      launch_elementwise<Apply<T, true, true>::template Kernel>(x.device(), g, a);
    } else {
      launch_elementwise<Apply<T, false, true>::template Kernel>(x.device(), g, a);
    }
  });
}

void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               Tensor& sum_dy, Tensor& sum_dy_xmu) {
  const BnGeometry g =
      check_reduce("batchnorm_backward_reduce", dy, x, mean, sum_dy, sum_dy_xmu);
  detail::with_storage(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    reduce_channels<2>(dy.device(), g,
                       GradientTerms<T, false>{storage_data<T>(dy), nullptr, storage_data<T>(x),
                                               mean.data<float>()},
                       StoreGradientSums{sum_dy.data<float>(), sum_dy_xmu.data<float>()});
  });
}

void batchnorm_backward_reduce_relu(const Tensor& dy, const Tensor& y, const Tensor& x,
                                    const Tensor& mean, Tensor& sum_dy, Tensor& sum_dy_xmu) {
  const char* op = "batchnorm_backward_reduce_relu";
  MTRAIN_CHECK(y.defined(), "{}: y is undefined", op);
  const BnGeometry g = check_reduce(op, dy, x, mean, sum_dy, sum_dy_xmu, y);
  detail::with_storage(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    reduce_channels<2>(dy.device(), g,
                       GradientTerms<T, true>{storage_data<T>(dy), storage_data<T>(y), storage_data<T>(x),
                                              mean.data<float>()},
                       StoreGradientSums{sum_dy.data<float>(), sum_dy_xmu.data<float>()});
  });
}

void batchnorm_backward_apply(const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& invstd, const Tensor& gamma, const Tensor& sum_dy,
                              const Tensor& sum_dy_xmu, double count, Tensor& dx) {
  const char* op = "batchnorm_backward_apply";
  const DType t = detail::activation_dtype(op, {{"dy", &dy}, {"x", &x}, {"dx", &dx}});
  detail::with_storage(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    BnGeometry g{};
    Tensor coefficients;
    const BackwardApplyArgs<T> a = backward_apply_args<T>(op, dy, x, mean, invstd, gamma, sum_dy, sum_dy_xmu,
                                                          count, dx, Tensor(), Tensor(), g, coefficients);
    launch_elementwise<BackwardApply<T, false, false>::template Kernel>(dy.device(), g, a);
  });
}

void batchnorm_backward_apply_relu(const Tensor& dy, const Tensor& y, const Tensor& x,
                                   const Tensor& mean, const Tensor& invstd, const Tensor& gamma,
                                   const Tensor& sum_dy, const Tensor& sum_dy_xmu, double count,
                                   Tensor& dx, Tensor& dmasked) {
  const char* op = "batchnorm_backward_apply_relu";
  MTRAIN_CHECK(y.defined(), "{}: y is undefined", op);
  const DType t = detail::activation_dtype(
      op, {{"dy", &dy}, {"y", &y}, {"x", &x}, {"dx", &dx}, {"dmasked", &dmasked}});
  detail::with_storage(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    BnGeometry g{};
    Tensor coefficients;
    const BackwardApplyArgs<T> a = backward_apply_args<T>(op, dy, x, mean, invstd, gamma, sum_dy, sum_dy_xmu,
                                                          count, dx, y, dmasked, g, coefficients);
    if (dmasked.defined()) {
      launch_elementwise<BackwardApply<T, true, true>::template Kernel>(dy.device(), g, a);
    } else {
      launch_elementwise<BackwardApply<T, true, false>::template Kernel>(dy.device(), g, a);
    }
  });
}

namespace detail {

void channel_sums(const Tensor& dy, bool channels_last, Tensor& db, bool accumulate) {
  const char* op = "channel_sums";
  MTRAIN_CHECK(dy.defined() && is_floating(dy.dtype()),
               "{}: dy must be a float32, bfloat16 or float16 tensor, found {}", op,
               dy.defined() ? dy.str() : "undefined");
  const Device device = first_gpu(op, "dy", dy, dy.dtype());
  check_ndim(op, "dy", dy, 4);
  // [N, C, H, W]: each channel's H*W planes; channels last: [N*H*W, C] rows (Note
  // [Batch-norm reductions over rows]).
  const BnGeometry g = channels_last ? BnGeometry{dy.size(0) * dy.size(1) * dy.size(2), dy.size(3), 1}
                                     : BnGeometry{dy.size(0), dy.size(1), dy.size(2) * dy.size(3)};
  check_on_shape(op, "db", db, device, {g.c});
  with_storage(dy.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    reduce_channels<1>(device, g, SumX<T>{storage_data<T>(dy)}, StoreChannelSum{db.data<float>(), accumulate});
  });
}

}  // namespace detail

}  // namespace mtrain::cuda_ops
