// The per-channel batch-norm ops (batchnorm_invstd, batchnorm_update_running,
// batchnorm_prepare, batchnorm_param_grads, batchnorm_merge_stats) on the CPU:
// hand-computed values, the formulas the layers used before these ops existed (bit for
// bit, since the multi-process SyncBatchNorm tests compare against single-process runs),
// and the merge against the statistics of the concatenated batch.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "tensor/ops.h"

using namespace mtrain;

namespace {

Tensor vec(const std::vector<float>& v) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

Tensor scalar_count(int64_t value) {
  Tensor t = Tensor::empty({}, DType::Int64);
  t.data<int64_t>()[0] = value;
  return t;
}

struct Sample {
  double mean = 0.0, biased_var = 0.0;
};

Sample stats_of(const std::vector<float>& values) {
  Sample s;
  for (float v : values) s.mean += v;
  s.mean /= static_cast<double>(values.size());
  for (float v : values) s.biased_var += (v - s.mean) * (v - s.mean);
  s.biased_var /= static_cast<double>(values.size());
  return s;
}

// SyncBatchNorm's merge as models/sync_batchnorm.cpp wrote it before the op existed.
void merge_as_before(const std::vector<float>& rows, int world, int64_t c, std::vector<float>& mean,
                     std::vector<float>& var) {
  const int64_t row = 2 * c + 1;
  for (int64_t i = 0; i < c; ++i) {
    double n = 0.0, avg = 0.0, m2 = 0.0;
    for (int r = 0; r < world; ++r) {
      const float* rank_row = rows.data() + r * row;
      const double n_j = rank_row[2 * c];
      if (n_j <= 0.0) continue;
      const double mean_j = rank_row[i];
      const double var_j = rank_row[c + i];
      const double n_new = n + n_j;
      const double delta = avg - mean_j;
      m2 += var_j * n_j + delta * delta * n * n_j / n_new;
      avg = (n * avg + n_j * mean_j) / n_new;
      n = n_new;
    }
    mean[i] = static_cast<float>(avg);
    var[i] = static_cast<float>(m2 / n);
  }
}

}  // namespace

TEST_CASE("batchnorm_invstd is 1 / sqrt(var + eps) in double", "[batchnorm_channels]") {
  // Exact cases: 3 + 1 = 4 -> 0.5; 0 + 0.25 -> 2.
  Tensor out = Tensor::empty({1});
  ops::batchnorm_invstd(vec({3.0f}), 1.0, out);
  CHECK(out.to_vector<float>()[0] == 0.5f);
  ops::batchnorm_invstd(vec({0.0f}), 0.25, out);
  CHECK(out.to_vector<float>()[0] == 2.0f);

  const std::vector<float> var = {0.0f, 1.0f, 1e-7f, 123.456f, 2.5e-3f};
  const double eps = 1e-5;
  Tensor invstd = Tensor::empty({5});
  ops::batchnorm_invstd(vec(var), eps, invstd);
  const std::vector<float> got = invstd.to_vector<float>();
  for (size_t c = 0; c < var.size(); ++c) {
    INFO("channel " << c);
    // The layer's former host loop, bit for bit.
    CHECK(got[c] == static_cast<float>(1.0 / std::sqrt(static_cast<double>(var[c]) + eps)));
  }
  CHECK(got[0] == Approx(1.0 / std::sqrt(1e-5)).epsilon(1e-7));

  Tensor wrong = Tensor::empty({4});
  CHECK_THROWS_AS(ops::batchnorm_invstd(vec(var), eps, wrong), InternalError);
}

TEST_CASE("batchnorm_update_running blends with momentum, unbiases the variance and counts",
          "[batchnorm_channels]") {
  Tensor running_mean = vec({1.0f, 2.0f, -0.5f});
  Tensor running_var = vec({1.0f, 4.0f, 0.25f});
  Tensor tracked = scalar_count(7);
  const Tensor mean = vec({3.0f, -1.0f, 0.125f});
  const Tensor var = vec({2.0f, 0.5f, 8.0f});
  const int64_t count = 5;
  const double momentum = 0.1;
  ops::batchnorm_update_running(mean, var, count, momentum, running_mean, running_var, tracked);

  // torch's definition in double: (1 - m) r + m x, with var * n / (n - 1).
  const std::vector<double> expected_mean = {0.9 * 1 + 0.1 * 3, 0.9 * 2 - 0.1, -0.45 + 0.0125};
  const std::vector<double> expected_var = {0.9 + 0.1 * 2 * 1.25, 3.6 + 0.1 * 0.5 * 1.25,
                                            0.225 + 0.1 * 8 * 1.25};
  const std::vector<float> rm = running_mean.to_vector<float>();
  const std::vector<float> rv = running_var.to_vector<float>();
  for (int c = 0; c < 3; ++c) {
    INFO("channel " << c);
    CHECK(rm[c] == Approx(expected_mean[c]).epsilon(1e-6));
    CHECK(rv[c] == Approx(expected_var[c]).epsilon(1e-6));
  }
  CHECK(tracked.data<int64_t>()[0] == 8);

  // Bit for bit what the layer computed before: scale_ by float(1 - m), then add_ of
  // float(m) * mean and float(m * n / (n - 1)) * var.
  Tensor old_mean = vec({1.0f, 2.0f, -0.5f});
  Tensor old_var = vec({1.0f, 4.0f, 0.25f});
  ops::scale_(old_mean, static_cast<float>(1.0 - momentum));
  ops::add_(old_mean, mean, static_cast<float>(momentum));
  ops::scale_(old_var, static_cast<float>(1.0 - momentum));
  ops::add_(old_var, var, static_cast<float>(momentum * 5.0 / 4.0));
  CHECK(rm == old_mean.to_vector<float>());
  CHECK(rv == old_var.to_vector<float>());
}

TEST_CASE("batchnorm_update_running at momentum 0 and 1, and its preconditions",
          "[batchnorm_channels]") {
  const Tensor mean = vec({3.0f, -1.0f});
  const Tensor var = vec({2.0f, 6.0f});
  Tensor running_mean = vec({1.0f, 2.0f});
  Tensor running_var = vec({1.0f, 4.0f});
  Tensor tracked = scalar_count(0);
  ops::batchnorm_update_running(mean, var, 4, 0.0, running_mean, running_var, tracked);
  CHECK(running_mean.to_vector<float>() == std::vector<float>{1.0f, 2.0f});
  CHECK(running_var.to_vector<float>() == std::vector<float>{1.0f, 4.0f});
  CHECK(tracked.data<int64_t>()[0] == 1);

  ops::batchnorm_update_running(mean, var, 4, 1.0, running_mean, running_var, tracked);
  CHECK(running_mean.to_vector<float>() == std::vector<float>{3.0f, -1.0f});
  // Unbiased: 2 * 4/3 and 6 * 4/3.
  CHECK(running_var.to_vector<float>()[0] == Approx(8.0 / 3.0).epsilon(1e-7));
  CHECK(running_var.to_vector<float>()[1] == 8.0f);
  CHECK(tracked.data<int64_t>()[0] == 2);

  // A count of 1 has no unbiased variance; the layers reject it before calling.
  CHECK_THROWS_AS(
      ops::batchnorm_update_running(mean, var, 1, 0.1, running_mean, running_var, tracked),
      InternalError);
  Tensor float_tracked = Tensor::zeros({});
  CHECK_THROWS_AS(
      ops::batchnorm_update_running(mean, var, 4, 0.1, running_mean, running_var, float_tracked),
      InternalError);
  CHECK(tracked.data<int64_t>()[0] == 2);
}

TEST_CASE("batchnorm_param_grads accumulates sum_dy_xmu * invstd and sum_dy",
          "[batchnorm_channels]") {
  const Tensor sum_dy = vec({1.5f, -2.0f, 0.0f});
  const Tensor sum_dy_xmu = vec({4.0f, 3.0f, -1.0f});
  const Tensor invstd = vec({0.5f, 2.0f, 0.25f});
  Tensor dgamma = vec({1.0f, 0.0f, -1.0f});
  Tensor dbeta = vec({0.25f, 0.5f, 0.0f});
  ops::batchnorm_param_grads(sum_dy, sum_dy_xmu, invstd, dgamma, dbeta);
  CHECK(dgamma.to_vector<float>() == std::vector<float>{3.0f, 6.0f, -1.25f});
  CHECK(dbeta.to_vector<float>() == std::vector<float>{1.75f, -1.5f, 0.0f});

  // Either gradient may be absent; the other still accumulates.
  Tensor no_grad;
  ops::batchnorm_param_grads(sum_dy, sum_dy_xmu, invstd, no_grad, dbeta);
  CHECK(dbeta.to_vector<float>() == std::vector<float>{3.25f, -3.5f, 0.0f});
  ops::batchnorm_param_grads(sum_dy, sum_dy_xmu, invstd, dgamma, no_grad);
  CHECK(dgamma.to_vector<float>() == std::vector<float>{5.0f, 12.0f, -1.5f});

  Tensor short_grad = vec({0.0f, 0.0f});
  CHECK_THROWS_AS(ops::batchnorm_param_grads(sum_dy, sum_dy_xmu, invstd, short_grad, dbeta),
                  InternalError);
}

TEST_CASE("batchnorm_merge_stats gives the statistics of the concatenated batch",
          "[batchnorm_channels]") {
  // Four ranks with uneven local batches, one of them empty; two channels.
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> dist(-3.0f, 5.0f);
  const std::vector<int> counts = {4, 0, 12, 1};
  const int world = static_cast<int>(counts.size());
  const int64_t c = 2, row = 2 * c + 1;
  std::vector<float> rows(static_cast<size_t>(world * row), 0.0f);
  std::vector<std::vector<float>> all(c);
  for (int r = 0; r < world; ++r) {
    for (int64_t ch = 0; ch < c; ++ch) {
      std::vector<float> values(static_cast<size_t>(counts[r]));
      for (float& v : values) v = dist(rng) + static_cast<float>(ch * 10);
      all[ch].insert(all[ch].end(), values.begin(), values.end());
      if (counts[r] == 0) {
        // An empty rank's row must not be read: make it poison if it were.
        rows[r * row + ch] = std::numeric_limits<float>::quiet_NaN();
        rows[r * row + c + ch] = 1e30f;
        continue;
      }
      const Sample s = stats_of(values);
      rows[r * row + ch] = static_cast<float>(s.mean);
      rows[r * row + c + ch] = static_cast<float>(s.biased_var);
    }
    rows[r * row + 2 * c] = static_cast<float>(counts[r]);
  }

  Tensor mean = Tensor::empty({c}), var = Tensor::empty({c});
  ops::batchnorm_merge_stats(Tensor::from_vector(rows, {world, row}), mean, var);
  const std::vector<float> got_mean = mean.to_vector<float>();
  const std::vector<float> got_var = var.to_vector<float>();
  for (int64_t ch = 0; ch < c; ++ch) {
    INFO("channel " << ch);
    const Sample whole = stats_of(all[ch]);
    // The rows carry float32 means and variances: relative error a few float32 ulps.
    CHECK(got_mean[ch] == Approx(whole.mean).epsilon(1e-6));
    CHECK(got_var[ch] == Approx(whole.biased_var).epsilon(1e-6));
  }

  // And bit for bit the loop SyncBatchNorm ran before (the NaN row is skipped there too).
  std::vector<float> old_mean(c), old_var(c);
  merge_as_before(rows, world, c, old_mean, old_var);
  CHECK(got_mean == old_mean);
  CHECK(got_var == old_var);
}

TEST_CASE("batchnorm_merge_stats: one contributing rank is returned exactly, none gives zeros",
          "[batchnorm_channels]") {
  // [mean(2), var(2), count] for three ranks; only rank 1 has values.
  const std::vector<float> rows = {9.0f, 9.0f, 9.0f, 9.0f, 0.0f,                  //
                                   0.1f, -7.3f, 0.0123f, 4.56f, 24.0f,          //
                                   -5.0f, 5.0f, 1e20f, 1e20f, 0.0f};
  Tensor mean = Tensor::empty({2}), var = Tensor::empty({2});
  ops::batchnorm_merge_stats(Tensor::from_vector(rows, {3, 5}), mean, var);
  CHECK(mean.to_vector<float>() == std::vector<float>{0.1f, -7.3f});
  CHECK(var.to_vector<float>() == std::vector<float>{0.0123f, 4.56f});

  const std::vector<float> empty_rows = {1.0f, 2.0f, 0.0f, 2.0f, 3.0f, 0.0f};
  Tensor mean1 = Tensor::empty({1}), var1 = Tensor::empty({1});
  ops::batchnorm_merge_stats(Tensor::from_vector(empty_rows, {2, 3}), mean1, var1);
  CHECK(mean1.to_vector<float>() == std::vector<float>{0.0f});
  CHECK(var1.to_vector<float>() == std::vector<float>{0.0f});

  // Rows must be [world, 2C+1] and match the outputs' C.
  CHECK_THROWS_AS(ops::batchnorm_merge_stats(Tensor::zeros({3, 4}), mean, var), InternalError);
  CHECK_THROWS_AS(ops::batchnorm_merge_stats(Tensor::zeros({15}), mean, var), InternalError);
  CHECK_THROWS_AS(ops::batchnorm_merge_stats(Tensor::zeros({3, 7}), mean, var), InternalError);
}

TEST_CASE("batchnorm_prepare is batchnorm_update_running then batchnorm_invstd, bit for bit",
          "[batchnorm_channels]") {
  const Tensor mean = vec({3.0f, -1.0f, 0.125f, 1e6f});
  const Tensor var = vec({2.0f, 0.5f, 8.0f, 1e-7f});
  Tensor rm = vec({1.0f, 2.0f, -0.5f, 0.0f}), rv = vec({1.0f, 4.0f, 0.25f, 1.0f});
  Tensor tracked = scalar_count(3);
  Tensor invstd = Tensor::empty({4});
  ops::batchnorm_prepare(mean, var, 7, 0.1, 1e-5, rm, rv, tracked, invstd);

  Tensor rm2 = vec({1.0f, 2.0f, -0.5f, 0.0f}), rv2 = vec({1.0f, 4.0f, 0.25f, 1.0f});
  Tensor tracked2 = scalar_count(3);
  Tensor invstd2 = Tensor::empty({4});
  ops::batchnorm_update_running(mean, var, 7, 0.1, rm2, rv2, tracked2);
  ops::batchnorm_invstd(var, 1e-5, invstd2);
  CHECK(rm.to_vector<float>() == rm2.to_vector<float>());
  CHECK(rv.to_vector<float>() == rv2.to_vector<float>());
  CHECK(invstd.to_vector<float>() == invstd2.to_vector<float>());
  CHECK(tracked.data<int64_t>()[0] == 4);
  // Its preconditions are update_running's.
  CHECK_THROWS_AS(ops::batchnorm_prepare(mean, var, 1, 0.1, 1e-5, rm, rv, tracked, invstd),
                  InternalError);
  Tensor short_invstd = Tensor::empty({3});
  CHECK_THROWS_AS(ops::batchnorm_prepare(mean, var, 7, 0.1, 1e-5, rm, rv, tracked, short_invstd),
                  InternalError);
}
