// Batch-norm kernels on the GPU: the counterparts of tensor/cpu/batchnorm.cpp (Note
// [Separable batch norm] in tensor/ops.h, Note [Kernel dispatch] in tensor/ops.cpp).
//
// Note [Deterministic batch-norm reductions on the GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A channel's sums run over N*H*W elements, millions in a large batch. As on the CPU
// (Note [Batch-norm reductions]) they accumulate in double and the variance is two-pass,
// so nothing cancels catastrophically. Unlike the CPU, the deviations are taken from
// the mean already rounded to float: where a channel's spread is near the float
// resolution of its mean (1e6 and its neighbours) the variance comes out higher by up to
// (half an ulp of the mean)^2. Each channel's elements, flattened in (n, h, w) order, are cut into
// `chunks` equal ranges; one block sums a range into a partial (per-thread double
// sums, then a fixed-order tree), and a second kernel adds a channel's partials in
// chunk order. No atomics: the result is the same on every run and every GPU model
// (the chunking depends on the shape alone), which SyncBatchNorm's equivalence tests
// and reproducible training rely on. Double accumulation costs little here: the
// kernels are bound by memory bandwidth, not arithmetic.
//
// The elementwise halves (apply, backward apply) round as the CPU kernels do (Note
// [Unfused float arithmetic] in tensor/cuda/launch.cuh), from per-channel constants
// computed with the CPU's formulas.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_on_shape;
using detail::first_gpu;
using detail::kThreads;
using detail::kWarpsPerBlock;

struct BnGeometry {
  int64_t n, c, area;
  __host__ __device__ int64_t count() const { return n * area; }  // elements per channel
};

BnGeometry bn_geometry(const char* op, const char* name, const Tensor& x) {
  first_gpu(op, name, x);
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
__global__ void channel_partials_kernel(Term term, BnGeometry g, int64_t chunks,
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

// One block per channel adds its partials in a fixed order and hands the sums to `finish`.
template <int kSums, class Finish>
__global__ void channel_finish_kernel(Finish finish, const double* partials, int64_t c,
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
  const int64_t chunks = chunks_per_channel(g);
  const int64_t blocks = g.c * chunks;
  MTRAIN_CHECK(g.c <= std::numeric_limits<int32_t>::max(),
               "batch norm: {} channels are more than one launch can cover", g.c);
  // Tensor has no float64 dtype: the double partials live in an Int64 tensor's bytes,
  // allocated on (and so ordered by) the current stream.
  Tensor scratch = Tensor::empty({kSums * blocks}, DType::Int64, device);
  double* partials = static_cast<double*>(scratch.raw_data());
  const cudaStream_t stream = detail::stream_for(device.index);
  cuda::DeviceGuard guard(device.index);
  if (g.count() <= std::numeric_limits<uint32_t>::max() - kThreads) {
    channel_partials_kernel<kSums, uint32_t>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(term, g, chunks, partials);
  } else {
    channel_partials_kernel<kSums, uint64_t>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(term, g, chunks, partials);
  }
  MTRAIN_CUDA_CHECK(cudaGetLastError());
  channel_finish_kernel<kSums><<<static_cast<unsigned>(g.c), kThreads, 0, stream>>>(
      finish, partials, g.c, chunks);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

struct SumX {
  const float* x;
  __device__ void operator()(int64_t offset, int64_t, double* acc) const { acc[0] += x[offset]; }
};

// (x - mean)^2 with the float mean widened (the CPU widens the double mean).
struct SquaredDeviation {
  const float* x;
  const float* mean;
  __device__ void operator()(int64_t offset, int64_t channel, double* acc) const {
    const double d = static_cast<double>(x[offset]) - static_cast<double>(mean[channel]);
    acc[0] += d * d;
  }
};

struct GradientTerms {
  const float* dy;
  const float* x;
  const float* mean;
  __device__ void operator()(int64_t offset, int64_t channel, double* acc) const {
    const double g = dy[offset];
    acc[0] += g;
    acc[1] += g * (static_cast<double>(x[offset]) - static_cast<double>(mean[channel]));
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

// ---- elementwise halves ---------------------------------------------------------------

// y = x * scale + shift with scale = invstd * gamma, shift = beta - mean * scale, each
// rounded as in tensor/cpu/batchnorm.cpp.
template <class Index>
__global__ void apply_kernel(const float* x, const float* mean, const float* invstd,
                             const float* gamma, const float* beta, float* y, Index total,
                             Index c, Index area) {
  for (Index i = static_cast<Index>(detail::global_thread_index()); i < total;
       i += static_cast<Index>(detail::grid_stride())) {
    const Index ch = (i / area) % c;
    const float scale = __fmul_rn(invstd[ch], gamma != nullptr ? gamma[ch] : 1.0f);
    const float shift = __fsub_rn(beta != nullptr ? beta[ch] : 0.0f, __fmul_rn(mean[ch], scale));
    y[i] = __fadd_rn(__fmul_rn(x[i], scale), shift);
  }
}

// The CPU's per-channel constants of the backward apply, in [3, C]: scale = gamma *
// invstd, mean_dy = sum_dy / count and proj = invstd^2 * sum_dy_xmu / count (in double).
__global__ void backward_coefficients_kernel(const float* gamma, const float* invstd,
                                             const float* sum_dy, const float* sum_dy_xmu,
                                             double inv_count, int64_t c, float* coefficients) {
  for (int64_t ch = detail::global_thread_index(); ch < c; ch += detail::grid_stride()) {
    const double is = invstd[ch];
    coefficients[ch] = __fmul_rn(gamma != nullptr ? gamma[ch] : 1.0f, invstd[ch]);
    coefficients[c + ch] = static_cast<float>(sum_dy[ch] * inv_count);
    coefficients[2 * c + ch] = static_cast<float>(is * is * sum_dy_xmu[ch] * inv_count);
  }
}

// dx = scale * (dy - mean_dy - (x - mean) * proj).
template <class Index>
__global__ void backward_apply_kernel(const float* dy, const float* x, const float* mean,
                                      const float* coefficients, float* dx, Index total, Index c,
                                      Index area) {
  for (Index i = static_cast<Index>(detail::global_thread_index()); i < total;
       i += static_cast<Index>(detail::grid_stride())) {
    const Index ch = (i / area) % c;
    const float scale = coefficients[ch];
    const float mean_dy = coefficients[c + ch];
    const float proj = coefficients[2 * c + ch];
    const float centered = __fmul_rn(__fsub_rn(x[i], mean[ch]), proj);
    dx[i] = __fmul_rn(scale, __fsub_rn(__fsub_rn(dy[i], mean_dy), centered));
  }
}

// Launches an elementwise kernel over `total` elements with 32-bit indices when they fit
// (grid_for keeps total + grid stride below 2^32 then).
template <class Launch32, class Launch64>
void launch_elementwise(Device device, int64_t total, Launch32 launch32, Launch64 launch64) {
  if (total == 0) return;
  cuda::DeviceGuard guard(device.index);
  const unsigned grid = detail::grid_for(total);
  const cudaStream_t stream = detail::stream_for(device.index);
  const int64_t max_index = total + static_cast<int64_t>(grid) * kThreads;
  if (max_index <= std::numeric_limits<uint32_t>::max()) {
    launch32(grid, stream);
  } else {
    launch64(grid, stream);
  }
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void batchnorm_stats(const Tensor& x, Tensor& mean, Tensor& var) {
  const BnGeometry g = bn_geometry("batchnorm_stats", "x", x);
  const Device device = x.device();
  check_on_shape("batchnorm_stats", "mean", mean, device, {g.c});
  check_on_shape("batchnorm_stats", "var", var, device, {g.c});
  if (g.c == 0) return;
  if (g.count() == 0) {
    // With no elements both are 0, not 0/0 (as on the CPU).
    mean.zero_();
    var.zero_();
    return;
  }
  const double count = static_cast<double>(g.count());
  reduce_channels<1>(device, g, SumX{x.data<float>()}, StoreAverage{mean.data<float>(), count});
  reduce_channels<1>(device, g, SquaredDeviation{x.data<float>(), mean.data<float>()},
                     StoreAverage{var.data<float>(), count});
}

void batchnorm_apply(const Tensor& x, const Tensor& mean, const Tensor& invstd,
                     const Tensor& gamma, const Tensor& beta, Tensor& y) {
  const char* op = "batchnorm_apply";
  const BnGeometry g = bn_geometry(op, "x", x);
  const Device device = x.device();
  check_on_shape(op, "mean", mean, device, {g.c});
  check_on_shape(op, "invstd", invstd, device, {g.c});
  check_on_shape(op, "y", y, device, x.shape());
  const float* pg = optional_param(op, "gamma", gamma, device, g.c);
  const float* pb = optional_param(op, "beta", beta, device, g.c);
  const float* px = x.data<float>();
  const float* pm = mean.data<float>();
  const float* pi = invstd.data<float>();
  float* py = y.data<float>();
  const int64_t total = x.numel();
  launch_elementwise(
      device, total,
      [&](unsigned grid, cudaStream_t stream) {
        apply_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(
            px, pm, pi, pg, pb, py, static_cast<uint32_t>(total), static_cast<uint32_t>(g.c),
            static_cast<uint32_t>(g.area));
      },
      [&](unsigned grid, cudaStream_t stream) {
        apply_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(
            px, pm, pi, pg, pb, py, static_cast<uint64_t>(total), static_cast<uint64_t>(g.c),
            static_cast<uint64_t>(g.area));
      });
}

void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               Tensor& sum_dy, Tensor& sum_dy_xmu) {
  const char* op = "batchnorm_backward_reduce";
  // dy is the first tensor and sets the device; x then must match it.
  const Device device = first_gpu(op, "dy", dy);
  const BnGeometry g = bn_geometry(op, "x", x);
  check_on_shape(op, "x", x, device, dy.shape());
  check_on_shape(op, "mean", mean, device, {g.c});
  check_on_shape(op, "sum_dy", sum_dy, device, {g.c});
  check_on_shape(op, "sum_dy_xmu", sum_dy_xmu, device, {g.c});
  reduce_channels<2>(device, g,
                     GradientTerms{dy.data<float>(), x.data<float>(), mean.data<float>()},
                     StoreGradientSums{sum_dy.data<float>(), sum_dy_xmu.data<float>()});
}

void batchnorm_backward_apply(const Tensor& dy, const Tensor& x, const Tensor& mean,
                              const Tensor& invstd, const Tensor& gamma, const Tensor& sum_dy,
                              const Tensor& sum_dy_xmu, double count, Tensor& dx) {
  const char* op = "batchnorm_backward_apply";
  const Device device = first_gpu(op, "dy", dy);
  const BnGeometry g = bn_geometry(op, "x", x);
  check_on_shape(op, "x", x, device, dy.shape());
  check_on_shape(op, "mean", mean, device, {g.c});
  check_on_shape(op, "invstd", invstd, device, {g.c});
  check_on_shape(op, "sum_dy", sum_dy, device, {g.c});
  check_on_shape(op, "sum_dy_xmu", sum_dy_xmu, device, {g.c});
  check_on_shape(op, "dx", dx, device, x.shape());
  MTRAIN_CHECK(count >= 0.0, "{}: count must be >= 0, got {}", op, count);
  const float* pg = optional_param(op, "gamma", gamma, device, g.c);
  const int64_t total = x.numel();
  if (total == 0) return;
  // With no elements anywhere the reductions are empty: their means are 0, not 0/0.
  const double inv_count = count > 0.0 ? 1.0 / count : 0.0;
  Tensor coefficients = Tensor::empty({3, g.c}, DType::Float32, device);
  float* pc = coefficients.data<float>();
  {
    cuda::DeviceGuard guard(device.index);
    backward_coefficients_kernel<<<detail::grid_for(g.c), kThreads, 0,
                                   detail::stream_for(device.index)>>>(
        pg, invstd.data<float>(), sum_dy.data<float>(), sum_dy_xmu.data<float>(), inv_count, g.c,
        pc);
    MTRAIN_CUDA_CHECK(cudaGetLastError());
  }
  const float* pdy = dy.data<float>();
  const float* px = x.data<float>();
  const float* pm = mean.data<float>();
  float* pdx = dx.data<float>();
  launch_elementwise(
      device, total,
      [&](unsigned grid, cudaStream_t stream) {
        backward_apply_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(
            pdy, px, pm, pc, pdx, static_cast<uint32_t>(total), static_cast<uint32_t>(g.c),
            static_cast<uint32_t>(g.area));
      },
      [&](unsigned grid, cudaStream_t stream) {
        backward_apply_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(
            pdy, px, pm, pc, pdx, static_cast<uint64_t>(total), static_cast<uint64_t>(g.c),
            static_cast<uint64_t>(g.area));
      });
}

}  // namespace mtrain::cuda_ops
