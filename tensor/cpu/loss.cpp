// Softmax cross-entropy and accuracy counting over logits[N,K].
#include <cmath>
#include <cstring>

#include "tensor/cpu/checks.h"
#include "tensor/cpu/cpu_ops.h"
#include "tensor/cpu/threading.h"
#include "tensor/ops.h"

namespace mtrain::ops {
namespace {

// Checks logits[N,K] and Int64 labels[N] (not the labels' values).
void check_logits_labels_shapes(const char* op, const Tensor& logits, const Tensor& labels) {
  cpu::check_float(op, "logits", logits);
  cpu::check_ndim(op, "logits", logits, 2);
  cpu::check_dtype(op, "labels", labels, DType::Int64);
  cpu::check_shape(op, "labels", labels, {logits.size(0)});
}

// The first row whose label lies outside [0, K), or -1.
int64_t first_bad_row(const Tensor& logits, const Tensor& labels) {
  const int64_t k = logits.size(1);
  const int64_t* pl = labels.data<int64_t>();
  for (int64_t i = 0; i < labels.numel(); ++i) {
    if (pl[i] < 0 || pl[i] >= k) return i;
  }
  return -1;
}

// Checks logits[N,K] and Int64 labels[N]; every label must lie in [0, K).
void check_logits_labels(const char* op, const Tensor& logits, const Tensor& labels) {
  check_logits_labels_shapes(op, logits, labels);
  if (const int64_t row = first_bad_row(logits, labels); row >= 0) {
    const int64_t k = logits.size(1);
    throw InvalidArgument(fmt::format("{}: label {} of sample {} is outside [0, {}): the data's "
                                      "classes do not match the model's {} outputs",
                                      op, labels.data<int64_t>()[row], row, k, k));
  }
}

}  // namespace

double cpu::cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& dlogits,
                          float grad_scale) {
  check_logits_labels("cross_entropy", logits, labels);
  if (dlogits.defined()) cpu::check_float_shape("cross_entropy", "dlogits", dlogits, logits.shape());
  MTRAIN_CHECK(logits.size(1) > 0, "cross_entropy: logits {} has no classes",
               shape_str(logits.shape()));
  cpu::use_configured_threads();
  const int64_t n = logits.size(0), k = logits.size(1);
  const float* pz = logits.data<float>();
  const int64_t* pl = labels.data<int64_t>();
  float* pd = dlogits.defined() ? dlogits.data<float>() : nullptr;
  double total = 0.0;
#pragma omp parallel for reduction(+ : total) if (n * k >= cpu::kParallelGrain)
  for (int64_t r = 0; r < n; ++r) {
    const float* z = pz + r * k;
    // log-sum-exp around the row maximum: no exp overflows, and the largest term is 1.
    float zmax = z[0];
    for (int64_t j = 1; j < k; ++j) zmax = z[j] > zmax ? z[j] : zmax;
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(z[j] - zmax));
    const double log_sum = std::log(sum);
    total += log_sum - (z[pl[r]] - zmax);
    if (pd != nullptr) {
      float* d = pd + r * k;
      for (int64_t j = 0; j < k; ++j) {
        const double softmax = std::exp(static_cast<double>(z[j] - zmax) - log_sum);
        d[j] = static_cast<float>(softmax - (j == pl[r] ? 1.0 : 0.0)) * grad_scale;
      }
    }
  }
  return total;
}

int64_t cpu::count_correct(const Tensor& logits, const Tensor& labels) {
  check_logits_labels("count_correct", logits, labels);
  const int64_t n = logits.size(0), k = logits.size(1);
  if (k == 0) return 0;
  const float* pz = logits.data<float>();
  const int64_t* pl = labels.data<int64_t>();
  int64_t correct = 0;
  for (int64_t r = 0; r < n; ++r) {
    const float* z = pz + r * k;
    // The first maximum wins on ties, like torch.argmax.
    int64_t best = 0;
    for (int64_t j = 1; j < k; ++j) {
      if (z[j] > z[best]) best = j;
    }
    if (best == pl[r]) ++correct;
  }
  return correct;
}

void cpu::loss_stats(const Tensor& logits, const Tensor& labels, Tensor& dlogits, float grad_scale,
                     Tensor& stats) {
  check_logits_labels_shapes("loss_stats", logits, labels);
  cpu::check_dtype("loss_stats", "stats", stats, DType::Int64);
  cpu::check_shape("loss_stats", "stats", stats, {kLossStats});
  if (dlogits.defined()) cpu::check_float_shape("loss_stats", "dlogits", dlogits, logits.shape());
  int64_t* out = stats.data<int64_t>();
  const int64_t bad = first_bad_row(logits, labels);
  double sum = 0.0;
  int64_t correct = 0;
  if (bad < 0) {
    sum = cpu::cross_entropy(logits, labels, dlogits, grad_scale);
    correct = cpu::count_correct(logits, labels);
  }
  std::memcpy(&out[0], &sum, sizeof(sum));
  out[1] = correct;
  out[2] = bad;
}

}  // namespace mtrain::ops
