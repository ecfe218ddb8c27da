// Softmax cross-entropy and accuracy counting on the GPU: the counterparts of
// tensor/cpu/loss.cpp (Note [Kernel dispatch] in tensor/ops.cpp).
//
// Note [Host results of GPU kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cross_entropy and count_correct return a host value, so each ends with one small
// device-to-host copy on the current stream and a wait for that stream alone (not the
// device: other streams, such as a collective's, keep running). loss_stats runs the same
// kernels into one device tensor and waits for nothing; whoever reads it checks the bad
// row (models/loss.cpp). Labels are checked on the device
// while the rows are processed: the kernels record the first row whose label lies
// outside [0, K) (atomicMin, so the row is the same whatever the scheduling), skip that
// row, and the host throws InvalidArgument with the CPU kernel's wording after the
// read-back. Only then is the label itself fetched, on the error path. When that
// happens, dlogits holds unspecified values (the CPU kernel checks before writing).
//
// One warp handles one row: K is small for classifiers (10, 100, 1000), and a warp
// needs no shared memory or block barriers for its max, sum and argmax. The loss is
// accumulated like the CPU's, in double (exp of the float difference to the row
// maximum), and the per-row losses are summed by one block in a fixed order, so the
// result is deterministic.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/launch.cuh"
#include "tensor/cuda/op_checks.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"

namespace mtrain::cuda_ops {
namespace {

using detail::check_ndim;
using detail::check_on_shape;
using detail::first_gpu;
using detail::kThreads;
using detail::kWarpSize;
using detail::kWarpsPerBlock;

constexpr unsigned long long kNoBadRow = ~0ull;

// Checks logits[N,K] and Int64 labels[N] on the same GPU (their values are checked on
// the device).
Device check_logits_labels(const char* op, const Tensor& logits, const Tensor& labels) {
  const Device device = first_gpu(op, "logits", logits);
  check_ndim(op, "logits", logits, 2);
  check_on_shape(op, "labels", labels, device, {logits.size(0)}, DType::Int64);
  return device;
}

// The CPU kernel's error for a label outside [0, K), for the first such row.
[[noreturn]] void throw_bad_label(const char* op, const Tensor& labels, int64_t row, int64_t k) {
  const int64_t label = labels.narrow0(row, 1).to_vector<int64_t>()[0];
  throw InvalidArgument(fmt::format("{}: label {} of sample {} is outside [0, {}): the data's "
                                    "classes do not match the model's {} outputs",
                                    op, label, row, k, k));
}

// Copies `bytes` back on the current stream and waits for that stream only.
void read_back(int device, const void* source, void* destination, size_t bytes) {
  const cudaStream_t stream = detail::stream_for(device);
  MTRAIN_CUDA_CHECK(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToHost, stream));
  MTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ bool label_outside(int64_t label, int64_t k) {
  return label < 0 || label >= k;
}

// Each warp takes rows first_row(), first_row() + row_stride(), ...; the bound and the
// row's label are the same for every lane, as the warp shuffles need.
__device__ __forceinline__ int64_t first_row() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
         static_cast<int64_t>(threadIdx.x) / kWarpSize;
}

__device__ __forceinline__ int64_t row_stride() {
  return static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
}

__global__ void cross_entropy_rows_kernel(const float* logits, const int64_t* labels,
                                          float* dlogits, float grad_scale, int64_t n, int64_t k,
                                          double* row_loss, unsigned long long* first_bad_row) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int64_t row = first_row(); row < n; row += row_stride()) {
    const int64_t label = labels[row];
    if (label_outside(label, k)) {
      if (lane == 0) {
        atomicMin(first_bad_row, static_cast<unsigned long long>(row));
        row_loss[row] = 0.0;
      }
      continue;
    }
    const float* z = logits + row * k;
    // log-sum-exp around the row maximum, as the CPU kernel: no exp overflows.
    float zmax = -INFINITY;
    for (int64_t j = lane; j < k; j += kWarpSize) zmax = fmaxf(zmax, z[j]);
    zmax = warp_max(zmax);
    double sum = 0.0;
    for (int64_t j = lane; j < k; j += kWarpSize) sum += exp(static_cast<double>(z[j] - zmax));
    const double log_sum = log(detail::warp_sum(sum));
    if (lane == 0) row_loss[row] = log_sum - static_cast<double>(z[label] - zmax);
    if (dlogits != nullptr) {
      float* d = dlogits + row * k;
      for (int64_t j = lane; j < k; j += kWarpSize) {
        const double softmax = exp(static_cast<double>(z[j] - zmax) - log_sum);
        d[j] = __fmul_rn(static_cast<float>(softmax - (j == label ? 1.0 : 0.0)), grad_scale);
      }
    }
  }
}

// One block adds the per-row losses in a fixed order.
__global__ void sum_rows_kernel(const double* row_loss, int64_t n, double* total) {
  __shared__ double shared[kWarpsPerBlock];
  double acc = 0.0;
  for (int64_t r = threadIdx.x; r < n; r += blockDim.x) acc += row_loss[r];
  acc = detail::block_sum(acc, shared);
  if (threadIdx.x == 0) *total = acc;
}

// The CPU's argmax (`if (z[j] > z[best]) best = j` from best = 0) in parallel: z[0] NaN
// gives 0; otherwise the first index of the largest non-NaN value. A lane without a
// candidate holds index k, which loses to any real index.
struct ArgMax {
  float value;
  int64_t index;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b, int64_t k) {
  if (a.index == k) return b;
  if (b.index == k) return a;
  if (a.value != b.value) return a.value > b.value ? a : b;
  return a.index < b.index ? a : b;
}

__global__ void count_correct_kernel(const float* logits, const int64_t* labels, int64_t n,
                                     int64_t k, unsigned long long* correct,
                                     unsigned long long* first_bad_row) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int64_t row = first_row(); row < n; row += row_stride()) {
    const int64_t label = labels[row];
    if (label_outside(label, k)) {
      if (lane == 0) atomicMin(first_bad_row, static_cast<unsigned long long>(row));
      continue;
    }
    const float* z = logits + row * k;
    ArgMax best{-INFINITY, k};
    for (int64_t j = lane; j < k; j += kWarpSize) {
      if (!isnan(z[j])) best = better(best, ArgMax{z[j], j}, k);
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const ArgMax other{__shfl_xor_sync(0xffffffffu, best.value, offset),
                         __shfl_xor_sync(0xffffffffu, best.index, offset)};
      best = better(best, other, k);
    }
    const int64_t argmax = isnan(z[0]) ? 0 : best.index;
    // Integer atomics add exactly, in any order.
    if (lane == 0 && argmax == label) atomicAdd(correct, 1ull);
  }
}

unsigned grid_for_rows(int64_t n) { return detail::grid_for(n, kWarpsPerBlock); }

// Queues the loss kernels: *total <- the sum of the rows' losses, dlogits (when defined)
// <- their gradient, *bad_row <- min(*bad_row, the first row with a label outside [0, K)).
// The row-loss scratch goes back to the allocator at once: its block is reused only by
// work queued after these kernels on the same stream.
void launch_cross_entropy(const Device device, const Tensor& logits, const Tensor& labels,
                          const Tensor& dlogits, float grad_scale, double* total,
                          unsigned long long* bad_row, cudaStream_t stream) {
  const int64_t n = logits.size(0), k = logits.size(1);
  Tensor row_loss = Tensor::empty({n}, DType::Int64, device);  // doubles, in an Int64 tensor's bytes
  cross_entropy_rows_kernel<<<grid_for_rows(n), kThreads, 0, stream>>>(
      logits.data<float>(), labels.data<int64_t>(),
      dlogits.defined() ? dlogits.data<float>() : nullptr, grad_scale, n, k,
      static_cast<double*>(row_loss.raw_data()), bad_row);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
  sum_rows_kernel<<<1, kThreads, 0, stream>>>(static_cast<const double*>(row_loss.raw_data()), n, total);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

// Queues *correct += the rows whose argmax is the label, *bad_row as above.
void launch_count_correct(const Tensor& logits, const Tensor& labels, unsigned long long* correct,
                          unsigned long long* bad_row, cudaStream_t stream) {
  const int64_t n = logits.size(0), k = logits.size(1);
  count_correct_kernel<<<grid_for_rows(n), kThreads, 0, stream>>>(
      logits.data<float>(), labels.data<int64_t>(), n, k, correct, bad_row);
  MTRAIN_CUDA_CHECK(cudaGetLastError());
}

// Zeroes words [0, zeros) and sets words [zeros, zeros + no_rows) to kNoBadRow.
void clear_words(unsigned long long* words, int zeros, int no_rows, cudaStream_t stream) {
  const size_t w = sizeof(unsigned long long);
  if (zeros > 0) MTRAIN_CUDA_CHECK(cudaMemsetAsync(words, 0, zeros * w, stream));
  MTRAIN_CUDA_CHECK(cudaMemsetAsync(words + zeros, 0xff, no_rows * w, stream));
}

}  // namespace

double cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& dlogits,
                     float grad_scale) {
  const char* op = "cross_entropy";
  const Device device = check_logits_labels(op, logits, labels);
  if (dlogits.defined()) check_on_shape(op, "dlogits", dlogits, device, logits.shape());
  const int64_t n = logits.size(0), k = logits.size(1);
  double total = 0.0;
  if (n > 0) {
    // [0] the total (a double in an Int64 tensor's bytes), [1] the first bad row.
    Tensor scratch = Tensor::empty({2}, DType::Int64, device);
    auto* words = static_cast<unsigned long long*>(scratch.raw_data());
    const cudaStream_t stream = detail::stream_for(device.index);
    cuda::DeviceGuard guard(device.index);
    clear_words(words + 1, 0, 1, stream);
    launch_cross_entropy(device, logits, labels, dlogits, grad_scale, reinterpret_cast<double*>(words),
                         words + 1, stream);
    struct {
      double total;
      unsigned long long first_bad_row;
    } result;
    static_assert(sizeof(result) == 2 * sizeof(unsigned long long));
    read_back(device.index, words, &result, sizeof(result));
    if (result.first_bad_row != kNoBadRow) {
      throw_bad_label(op, labels, static_cast<int64_t>(result.first_bad_row), k);
    }
    total = result.total;
  }
  MTRAIN_CHECK(k > 0, "{}: logits {} has no classes", op, shape_str(logits.shape()));
  return total;
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  const char* op = "count_correct";
  const Device device = check_logits_labels(op, logits, labels);
  const int64_t n = logits.size(0), k = logits.size(1);
  if (n == 0) return 0;
  // [0] the count, [1] the first bad row.
  Tensor scratch = Tensor::empty({2}, DType::Int64, device);
  auto* words = static_cast<unsigned long long*>(scratch.raw_data());
  const cudaStream_t stream = detail::stream_for(device.index);
  cuda::DeviceGuard guard(device.index);
  clear_words(words, 1, 1, stream);
  launch_count_correct(logits, labels, words, words + 1, stream);
  unsigned long long result[2];
  read_back(device.index, words, result, sizeof(result));
  if (result[1] != kNoBadRow) throw_bad_label(op, labels, static_cast<int64_t>(result[1]), k);
  return static_cast<int64_t>(result[0]);
}

void loss_stats(const Tensor& logits, const Tensor& labels, Tensor& dlogits, float grad_scale,
                Tensor& stats) {
  const char* op = "loss_stats";
  const Device device = check_logits_labels(op, logits, labels);
  if (dlogits.defined()) check_on_shape(op, "dlogits", dlogits, device, logits.shape());
  check_on_shape(op, "stats", stats, device, {ops::kLossStats}, DType::Int64);
  // [0] the loss sum (a double's bits: 0 is 0.0), [1] the count, [2] the first bad row
  // (kNoBadRow is -1 as an Int64).
  auto* words = static_cast<unsigned long long*>(stats.raw_data());
  const cudaStream_t stream = detail::stream_for(device.index);
  cuda::DeviceGuard guard(device.index);
  clear_words(words, 2, 1, stream);
  if (logits.size(0) == 0) return;
  launch_cross_entropy(device, logits, labels, dlogits, grad_scale, reinterpret_cast<double*>(words),
                       words + 2, stream);
  launch_count_correct(logits, labels, words + 1, words + 2, stream);
}

}  // namespace mtrain::cuda_ops
