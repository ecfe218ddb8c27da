// A worker for the SyncBatchNorm tests, started by mtrain-launch (which hosts the store
// and sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, MTRAIN_STORE_TOKEN). Usage:
//
//   syncbn_test_worker SIZES HxW      e.g. "4,2,0 5x3": rank r owns SIZES[r] rows
//
// Every rank builds the same deterministic full batch [sum(SIZES), C, H, W] and upstream
// gradient for two training steps, runs a plain BatchNorm2d on the full batch as the
// single-process reference, runs a SyncBatchNorm on its own rows, and checks its output
// rows, its input-gradient rows, the all-reduced weight/bias gradients and, after both
// steps, the running statistics against the reference. A mismatch (or an error such as
// a global batch of one) exits non-zero with a message and an MTRAIN_ERROR_FILE;
// success prints "rank R: OK".
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "collectives/bootstrap.h"
#include "collectives/process_group.h"
#include "core/env.h"
#include "core/error.h"
#include "core/main_guard.h"
#include "models/batchnorm.h"
#include "models/sync_batchnorm.h"

using namespace mtrain;
using namespace mtrain::models;

namespace {

constexpr int64_t kChannels = 3;
constexpr int kSteps = 2;

// float32 tolerance: every compared value is O(1) (inputs are normalised) and passes
// through a handful of float32 roundings on each side (statistics rounded from double,
// sums of per-rank partials added in a different order, the normalisation itself),
// each ~6e-8 relative. 1e-5 of the tensor's largest magnitude leaves two orders of
// magnitude for that, yet is far below what any real error produces: the local-only
// control below (plain BatchNorm2d on this rank's rows) misses by more than 1e-2.
constexpr double kTolerance = 1e-5;

std::vector<int64_t> parse_sizes(const std::string& text) {
  std::vector<int64_t> sizes;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    sizes.push_back(env::parse_int(text.substr(start, comma - start), "SIZES", 0, 1 << 20));
    start = comma + 1;
  }
  return sizes;
}

// Largest |got - want| relative to max(1, max |want|); NaN if any element is NaN.
double max_relative_error(const Tensor& got, const Tensor& want) {
  if (got.numel() != want.numel()) {
    throw InternalError(fmt::format("comparing {} with {}", got.str(), want.str()));
  }
  const float* g = got.data<float>();
  const float* w = want.data<float>();
  double scale = 1.0, err = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(double{w[i]}));
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double d = std::abs(double{g[i]} - w[i]);
    if (std::isnan(d) || d > err) err = d;  // std::max would drop a NaN
    if (std::isnan(err)) break;
  }
  return err / scale;
}

void expect_close(int rank, const std::string& what, const Tensor& got, const Tensor& want) {
  const double err = max_relative_error(got, want);
  if (!(err <= kTolerance)) {
    throw InternalError(
        fmt::format("rank {}: {} differs from the single-process reference by "
                    "{:.3g} (relative), tolerance {:.0e}",
                    rank, what, err, kTolerance));
  }
}

// Per channel c: offset 3 + c and scale 0.5 + c, so the per-rank means differ and the
// merge's between-rank term matters.
Tensor make_batch(const Shape& shape, uint32_t seed, bool offset) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  Tensor t = Tensor::empty(shape);
  float* p = t.data<float>();
  const int64_t area = shape[2] * shape[3];
  for (int64_t i = 0; i < t.numel(); ++i) {
    const auto c = static_cast<float>((i / area) % shape[1]);
    p[i] = offset ? 3.0f + c + (0.5f + c) * normal(gen) : normal(gen);
  }
  return t;
}

void set_affine(BatchNorm2d& bn) {
  for (int64_t c = 0; c < kChannels; ++c) {
    bn.weight().value.data<float>()[c] = 0.5f + 0.25f * static_cast<float>(c);
    bn.bias().value.data<float>()[c] = 0.1f * static_cast<float>(c) - 0.2f;
  }
}

void compare_with_reference(const std::shared_ptr<ProcessGroup>& group,
                            const std::vector<int64_t>& sizes, int64_t h, int64_t w) {
  const int rank = group->rank();
  int64_t total = 0, first_row = 0;
  for (int r = 0; r < group->size(); ++r) {
    if (r == rank) first_row = total;
    total += sizes[r];
  }
  const int64_t rows = sizes[rank];

  BatchNorm2d reference(kChannels);
  SyncBatchNorm sync(kChannels, group);
  BatchNorm2d local_only(kChannels);  // the control: what no synchronisation would give
  set_affine(reference);
  set_affine(sync);
  set_affine(local_only);

  for (int step = 0; step < kSteps; ++step) {
    const Shape full{total, kChannels, h, w};
    const Tensor x = make_batch(full, 1000 + step, /*offset=*/true);
    const Tensor dy = make_batch(full, 2000 + step, /*offset=*/false);
    reference.zero_grad();
    sync.zero_grad();

    // SyncBatchNorm first, so that its error (not the reference's) reports a bad batch.
    const Tensor x_mine = x.narrow0(first_row, rows).clone();
    const Tensor dy_mine = dy.narrow0(first_row, rows).clone();
    const Tensor y = sync.forward(x_mine);
    const Tensor dx = sync.backward(dy_mine);

    const Tensor y_ref = reference.forward(x);
    const Tensor dx_ref = reference.backward(dy);

    const std::string at = fmt::format("step {}", step);
    expect_close(rank, at + " output rows", y, y_ref.narrow0(first_row, rows));
    expect_close(rank, at + " input-gradient rows", dx, dx_ref.narrow0(first_row, rows));

    // Local weight/bias gradients are partial sums; DDP would add them across ranks.
    Tensor grads = Tensor::empty({2 * kChannels});
    grads.flat_view(0, {kChannels}).copy_(sync.weight().grad);
    grads.flat_view(kChannels, {kChannels}).copy_(sync.bias().grad);
    group->allreduce(grads)->wait();
    expect_close(rank, at + " summed weight gradient", grads.flat_view(0, {kChannels}),
                 reference.weight().grad);
    expect_close(rank, at + " summed bias gradient", grads.flat_view(kChannels, {kChannels}),
                 reference.bias().grad);

    if (rows >= 2 && rows < total) {
      const double control =
          max_relative_error(local_only.forward(x_mine), y_ref.narrow0(first_row, rows));
      if (!(control > 1e-2)) {
        throw InternalError(fmt::format(
            "rank {}: {}: local-only batch norm is within {:.3g} of the reference, so this "
            "batch cannot tell synchronised statistics from local ones",
            rank, at, control));
      }
    }
  }

  expect_close(rank, "running_mean", sync.running_mean(), reference.running_mean());
  expect_close(rank, "running_var", sync.running_var(), reference.running_var());
  if (sync.num_batches_tracked() != kSteps || reference.num_batches_tracked() != kSteps) {
    throw InternalError(
        fmt::format("rank {}: num_batches_tracked is {} (reference {}), expected {}", rank,
                    sync.num_batches_tracked(), reference.num_batches_tracked(), kSteps));
  }

  // Eval mode must not communicate: a rank-local forward on ranks of different sizes
  // completes even though the other ranks never join anything.
  sync.eval();
  reference.eval();
  if (rows > 0) {
    const Tensor x = make_batch({total, kChannels, h, w}, 3000, /*offset=*/true);
    expect_close(rank, "eval output rows", sync.forward(x.narrow0(first_row, rows).clone()),
                 reference.forward(x).narrow0(first_row, rows));
  }
}

// The launcher names the rank with the earliest error file as the root cause.
void report_failure(int rank, const std::string& message) {
  std::fprintf(stderr, "syncbn_test_worker: error: %s\n", message.c_str());
  std::fflush(stderr);
  const auto path = env::get("MTRAIN_ERROR_FILE");
  if (!path || path->empty()) return;
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::ofstream(*path)
      << nlohmann::json{{"rank", rank}, {"message", message}, {"timestamp", now}}.dump() << "\n";
}

int run(int argc, char** argv) {
  if (argc != 3) throw InvalidArgument("usage: syncbn_test_worker SIZES HxW (e.g. 4,2,0 5x3)");
  const int rank = static_cast<int>(env::get_int("RANK", 0).value_or(0));
  const int world = static_cast<int>(env::get_int("WORLD_SIZE", 1).value_or(1));
  const std::vector<int64_t> sizes = parse_sizes(argv[1]);
  if (static_cast<int>(sizes.size()) != world) {
    throw InvalidArgument(
        fmt::format("SIZES '{}' has {} entries for {} ranks", argv[1], sizes.size(), world));
  }
  const std::string hw = argv[2];
  const size_t x_at = hw.find('x');
  if (x_at == std::string::npos) throw InvalidArgument("expected HxW, found '" + hw + "'");
  const int64_t h = env::parse_int(hw.substr(0, x_at), "H", 1, 1024);
  const int64_t w = env::parse_int(hw.substr(x_at + 1), "W", 1, 1024);

  ProcessGroupOptions options;
  options.timeout = Millis(20000);
  std::shared_ptr<ProcessGroup> group(
      create_process_group("gloo", connect_store_from_env().store, rank, world, Device::cpu(), options));
  // Report while the group is still alive: unwinding destroys it, which closes the
  // connections, and a peer failing on the closed connection could otherwise reach the
  // launcher first and have this rank stopped before it prints the real cause.
  try {
    compare_with_reference(group, sizes, h, w);
  } catch (const std::exception& e) {
    report_failure(rank, e.what());
    return 1;
  }
  group->barrier()->wait();
  std::printf("rank %d: OK\n", rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return run_main("syncbn_test_worker", [&] { return run(argc, argv); });
}
