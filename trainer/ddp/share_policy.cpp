#include "trainer/ddp/share_policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/env.h"
#include "core/error.h"
#include "data/distributed_sampler.h"

namespace mtrain {

namespace {

constexpr int64_t kPicosecondsPerNanosecond = 1000;
constexpr int64_t kSpeedScale = 1'000'000'000'000'000'000;  // speed = kSpeedScale / ps per image

// The slowest rank's compute for `shares`, in picoseconds: the step's compute-bound time.
__int128 predicted_step(const std::vector<int64_t>& shares, const std::vector<int64_t>& picoseconds) {
  __int128 slowest = 0;
  for (size_t r = 0; r < shares.size(); ++r) {
    slowest = std::max(slowest, static_cast<__int128>(shares[r]) * picoseconds[r]);
  }
  return slowest;
}

double seconds_from_picoseconds(__int128 ps) { return static_cast<double>(ps) * 1e-12; }

}  // namespace

SharePolicy::SharePolicy(BalanceOptions options)
    : options_(std::move(options)), shares_(options_.initial_shares) {
  const int world = static_cast<int>(shares_.size());
  if (world < 1 || options_.global_batch < 1) {
    throw InvalidArgument(fmt::format("balance: expected a global batch >= 1 and one share per rank, found {} and {} "
                                      "shares",
                                      options_.global_batch, world));
  }
  int64_t sum = 0;
  for (int64_t s : shares_) {
    if (s < 0) throw InvalidArgument(fmt::format("balance: expected shares >= 0, found {}", s));
    sum += s;
  }
  if (sum != options_.global_batch) {
    throw InvalidArgument(fmt::format("balance: expected shares summing to the global batch {}, found {} (sum {})",
                                      options_.global_batch, format_shares(shares_), sum));
  }
  if (options_.window_steps < 1 || options_.min_samples < 1) {
    throw InvalidArgument(fmt::format("balance: expected a window and a sample count >= 1, found {} and {}",
                                      options_.window_steps, options_.min_samples));
  }
  even_ = data::split_global_batch(options_.global_batch, world);
  windows_.assign(shares_.size(), {});
}

// Note [Measuring each rank's speed]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each rank times its own forward and backward of every step (trainer/loop/compute_timer.h): the
// work that scales with its share, without the data wait, the optimizer or the wait for its
// peers after backward. The last micro-batch's exchange (Note [Agreeing to stop] in step_exchange.cpp)
// carries that time and the step's image count to every rank, one step late and at no extra
// round trip, so every rank observes the same figures. Per image, in integer picoseconds, each
// rank's speed is the mean of its last window_steps values. A mean, not a median or a short
// exponential average: a rank sharing its core is preempted in some steps and not in others
// (measured with lenet: 3-5 ms or 8-10 ms for the same 26 images), and the mean of those is
// what the rank delivers; a window of 16 halves a short average's noise yet follows a drift
// within a few steps. Ignored: the first steps (warmup_steps, after the first shape: one-off
// allocations, algorithm searches) and any step whose per-rank image counts differ from the step
// before (a new batch shape costs its own first-time work, and the last partial batch of an
// epoch is no guide). A rank without images at a step measures nothing.
std::optional<ShareChange> SharePolicy::observe(int64_t step, const std::vector<RankCompute>& ranks) {
  if (ranks.empty()) return std::nullopt;  // no exchange yet
  MTRAIN_CHECK(ranks.size() == shares_.size(), "{} ranks measured, {} have shares", ranks.size(), shares_.size());
  std::vector<int64_t> images(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) images[r] = ranks[r].images;
  const bool same_shape = images == previous_images_;
  previous_images_ = images;
  if (!same_shape) return std::nullopt;
  for (const RankCompute& c : ranks) {
    if (c.images > 0 && c.nanoseconds < 0) return std::nullopt;  // some rank could not measure
  }
  if (valid_steps_++ < options_.warmup_steps) return std::nullopt;

  // Note [What balancing saved]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A synchronous step ends when its slowest rank has computed, so per measured step the split
  // cost the largest compute time among the ranks, and the even split would have cost the largest
  // even_r * (that rank's time per image). Summed over the measured steps they give the summary's
  // estimate. It leaves out what does not scale with the share (communication, the optimizer) and
  // that time per image is not quite constant in the batch size.
  double slowest_ns = 0.0;
  double even_ns = 0.0;
  bool every_rank_known = true;
  const std::vector<int64_t> means = picoseconds_per_image();  // for ranks without images
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].images > 0) {
      const int64_t ps = std::max<int64_t>(
          1, static_cast<int64_t>(static_cast<__int128>(ranks[r].nanoseconds) * kPicosecondsPerNanosecond /
                                  ranks[r].images));
      std::vector<int64_t>& window = windows_[r];
      if (static_cast<int64_t>(window.size()) == options_.window_steps) window.erase(window.begin());
      window.push_back(ps);
      slowest_ns = std::max(slowest_ns, static_cast<double>(ranks[r].nanoseconds));
      even_ns = std::max(even_ns, static_cast<double>(even_[r]) * static_cast<double>(ranks[r].nanoseconds) /
                                      static_cast<double>(ranks[r].images));
    } else if (!windows_[r].empty()) {
      even_ns = std::max(even_ns, static_cast<double>(even_[r]) *
                                      static_cast<double>(means[r]) /
                                      static_cast<double>(kPicosecondsPerNanosecond));
    } else {
      every_rank_known = false;
    }
  }
  if (every_rank_known) {
    measured_ns_ += slowest_ns;
    even_ns_ += even_ns;
    ++measured_steps_;
  }
  if (!options_.automatic) return std::nullopt;
  if (last_change_step_ >= 0 && step - last_change_step_ < options_.min_interval) return std::nullopt;
  return propose(step);
}

// Note [When the shares change]: (gain / now)^2 >= 4 * max over the ranks with images of
// var_r / (n_r * mean_r^2), in parts per million, in 128-bit integers: with n values x of a window,
// var / mean^2 = (n * sum x^2 - (sum x)^2) / (sum x)^2.
bool SharePolicy::beats_noise(__int128 now, __int128 then) const {
  constexpr __int128 kPpm = 1'000'000;
  __int128 noisiest = 0;  // max of var / (n mean^2), in ppm
  for (size_t r = 0; r < windows_.size(); ++r) {
    const std::vector<int64_t>& w = windows_[r];
    if (shares_[r] == 0 || w.size() < 2) continue;
    __int128 sum = 0, squares = 0;
    for (int64_t x : w) {
      sum += x;
      squares += static_cast<__int128>(x) * x;
    }
    const __int128 n = static_cast<__int128>(w.size());
    // Scaled down by the mean first, so that the ppm factor cannot overflow.
    const __int128 mean = sum / n;
    if (mean == 0) continue;
    const __int128 spread = (n * squares - sum * sum) / (n * mean);  // n * var / mean
    noisiest = std::max(noisiest, spread * kPpm / (n * mean) / n);
  }
  const __int128 gain_ppm = (now - then) * kPpm / now;
  return gain_ppm * gain_ppm >= 4 * noisiest * kPpm;
}

std::vector<int64_t> SharePolicy::picoseconds_per_image() const {
  std::vector<int64_t> mean(windows_.size(), 0);
  for (size_t r = 0; r < windows_.size(); ++r) {
    if (windows_[r].empty()) continue;
    __int128 sum = 0;
    for (int64_t ps : windows_[r]) sum += ps;
    mean[r] = static_cast<int64_t>(sum / static_cast<__int128>(windows_[r].size()));
  }
  return mean;
}

// Note [When the shares change]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The proposal splits the global batch in proportion to speed (1 / mean time per image) by
// apportion(), at least one image per rank. It is adopted only when its predicted compute-bound
// step (the slowest rank's share times its time per image) is at least min_gain_percent shorter
// than that of the shares in force, and min_interval steps after the last change. Together they
// keep noise from moving the split back and forth: a proposal within a few percent of the current
// split is not worth re-planning the loader and a new batch shape, and the interval spaces the
// changes out (the 16-step means still hold samples of the old shapes then, which is fine as long
// as time per image hardly depends on the batch size, and the noise floor below sees them as
// spread). The gain must also be at least twice
// the noisiest mean's relative standard error (beats_noise): with short steps (lenet's 5 ms) the
// ranks' 16-step means of equal speeds differ by 10 % now and then, and moving an image on that
// would follow noise, not speed. A real drift (a
// neighbour starting on a rank's cores) moves the prediction by far more and is followed.
//
// Note [A hopeless rank]
// ~~~~~~~~~~~~~~~~~~~~~~
// A rank so slow that one image takes it longer than the others need for the whole global batch
// without it only holds every step back. Unless SyncBatchNorm needs every rank in every forward,
// such a rank gets no images (it still joins every collective with an empty batch, Note
// [Gradients are views into the buckets] in reducer.cpp), and the log says so. Never rank 0:
// without SyncBatchNorm every rank takes rank 0's BatchNorm statistics (Note [Buffers follow rank
// 0] in train_loop.cpp), which a rank without images would never update. A rank without
// images measures nothing, so it stays out while its last figure stands; it comes back when the
// others slow down enough that one image on it no longer holds the step back.
std::optional<ShareChange> SharePolicy::propose(int64_t step) {
  const size_t world = shares_.size();
  const std::vector<int64_t> picoseconds = picoseconds_per_image();
  std::vector<int64_t> weights(world, 0);
  for (size_t r = 0; r < world; ++r) {
    if (picoseconds[r] == 0 || static_cast<int64_t>(windows_[r].size()) < options_.min_samples) {
      if (shares_[r] > 0) return std::nullopt;  // a rank with images, not measured enough yet
      continue;
    }
    weights[r] = kSpeedScale / picoseconds[r];
  }
  std::vector<int> hopeless;
  if (options_.allow_empty_share) {
    std::vector<size_t> slowest_first(world);
    for (size_t r = 0; r < world; ++r) slowest_first[r] = r;
    std::stable_sort(slowest_first.begin(), slowest_first.end(), [&](size_t a, size_t b) {
      return picoseconds[a] > picoseconds[b];
    });
    for (size_t r : slowest_first) {
      if (r == 0) break;  // rank 0's buffers are every rank's (Note [A hopeless rank])
      if (weights[r] == 0) continue;
      std::vector<int64_t> others = weights;
      others[r] = 0;
      if (std::count_if(others.begin(), others.end(), [](int64_t w) { return w > 0; }) == 0) break;
      const __int128 without = predicted_step(data::apportion(options_.global_batch, others, 1), picoseconds);
      if (picoseconds[r] <= without) break;
      weights[r] = 0;
      hopeless.push_back(static_cast<int>(r));
    }
  }
  const std::vector<int64_t> proposed = data::apportion(options_.global_batch, weights, 1);
  if (proposed == shares_) return std::nullopt;
  const __int128 now = predicted_step(shares_, picoseconds);
  const __int128 then = predicted_step(proposed, picoseconds);
  if ((now - then) * 100 < now * options_.min_gain_percent) return std::nullopt;
  if (!beats_noise(now, then)) return std::nullopt;
  ShareChange change;
  change.step = step;
  change.before = shares_;
  change.after = proposed;
  for (int64_t ps : picoseconds) change.seconds_per_image.push_back(seconds_from_picoseconds(ps));
  change.predicted_before = seconds_from_picoseconds(now);
  change.predicted_after = seconds_from_picoseconds(then);
  change.hopeless = std::move(hopeless);
  shares_ = proposed;
  last_change_step_ = step;
  ++changes_;
  return change;
}

std::vector<std::optional<double>> SharePolicy::seconds_per_image() const {
  std::vector<std::optional<double>> out;
  for (int64_t ps : picoseconds_per_image()) {
    out.push_back(ps > 0 ? std::optional<double>(seconds_from_picoseconds(ps)) : std::nullopt);
  }
  return out;
}

BalanceSpec parse_balance(const std::string& text) {
  if (text == "even") return {};
  if (text == "auto") return {BalanceSpec::Kind::kAuto, {}};
  const std::string prefix = "static:";
  if (text.rfind(prefix, 0) == 0) {
    BalanceSpec spec{BalanceSpec::Kind::kStatic, {}};
    const std::string list = text.substr(prefix.size());
    size_t begin = 0;
    for (;;) {
      const size_t comma = list.find(',', begin);
      const std::string item = list.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
      spec.shares.push_back(env::parse_int(item, "--balance static: each rank's share", 0, 1'000'000));
      if (comma == std::string::npos) break;
      begin = comma + 1;
    }
    return spec;
  }
  throw InvalidArgument(fmt::format(
      "--balance: expected even, auto or static:N0,N1,... (one share per rank, summing to --global-batch-size), "
      "found '{}'",
      text));
}

std::string format_shares(const std::vector<int64_t>& shares) { return fmt::format("{}", fmt::join(shares, ",")); }

}  // namespace mtrain
