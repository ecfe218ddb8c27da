// The share arithmetic of --balance (trainer/ddp/share_policy.h), fed with made-up
// measurements: proportional shares, warm-up, hysteresis, the minimum interval, hopeless
// ranks, the savings estimate and --balance's parsing.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "trainer/ddp/share_policy.h"

using namespace mtrain;
using Catch::Matchers::Contains;
using Shares = std::vector<int64_t>;

namespace {

BalanceOptions automatic(int64_t g, Shares initial) {
  BalanceOptions o;
  o.global_batch = g;
  o.initial_shares = std::move(initial);
  o.automatic = true;
  return o;
}

// What each rank reports when it computes its share at `ms_per_image[r]` (scaled by
// `noise[r]`, 1 = none).
std::vector<RankCompute> measured(const Shares& shares, const std::vector<double>& ms_per_image,
                                  const std::vector<double>& noise = {}) {
  std::vector<RankCompute> out;
  for (size_t r = 0; r < shares.size(); ++r) {
    const double factor = noise.empty() ? 1.0 : noise[r];
    out.push_back({static_cast<int64_t>(std::llround(static_cast<double>(shares[r]) * ms_per_image[r] * factor * 1e6)),
                   shares[r]});
  }
  return out;
}

// Feeds `steps` steps in which every rank computes at its speed with the shares in force,
// as the job would (a change applies to the steps after it); returns the steps at which
// the shares changed.
std::vector<int64_t> run(SharePolicy& b, int64_t first, int64_t steps, const std::vector<double>& ms_per_image,
                         const std::vector<std::vector<double>>& noise = {}) {
  std::vector<int64_t> changes;
  for (int64_t step = first; step < first + steps; ++step) {
    const auto n = noise.empty() ? std::vector<double>{} : noise[static_cast<size_t>(step) % noise.size()];
    if (b.observe(step, measured(b.shares(), ms_per_image, n))) changes.push_back(step);
  }
  return changes;
}

}  // namespace

TEST_CASE("a rank at half speed gets a third of the global batch within a few steps", "[balance]") {
  SharePolicy b(automatic(90, {45, 45}));
  // The first step (a new shape), two warm-up steps and the first two samples decide nothing.
  for (int64_t step = 1; step <= 5; ++step) CHECK_FALSE(b.observe(step, measured({45, 45}, {1.0, 2.0})));
  const auto change = b.observe(6, measured({45, 45}, {1.0, 2.0}));
  REQUIRE(change);
  CHECK(change->before == Shares{45, 45});
  CHECK(change->after == Shares{60, 30});
  CHECK(change->step == 6);
  CHECK(change->seconds_per_image[0] == Approx(1e-3));
  CHECK(change->seconds_per_image[1] == Approx(2e-3));
  CHECK(change->predicted_before == Approx(0.090));  // 45 images at 2 ms
  CHECK(change->predicted_after == Approx(0.060));
  CHECK(change->hopeless.empty());
  CHECK(b.shares() == Shares{60, 30});
  // At the balance point nothing moves again.
  CHECK(run(b, 5, 100, {1.0, 2.0}).empty());
}

TEST_CASE("noise within a few percent never moves the split", "[balance]") {
  SharePolicy b(automatic(256, {128, 128}));
  // Equal speeds, each step one rank 4 % slower than the other, alternating.
  const std::vector<std::vector<double>> noise = {{1.04, 1.0}, {1.0, 1.04}, {1.03, 0.99}, {0.98, 1.02}};
  CHECK(run(b, 1, 300, {2.0, 2.0}, noise).empty());
  CHECK(b.shares() == Shares{128, 128});
}

TEST_CASE("noisy short steps of equal speed do not move the split; a real difference still does", "[balance]") {
  // Steps of a few milliseconds: each rank's step is 15-25 % off now and then (the OS), so the
  // 16-step means of two equal ranks differ by more than 5 % at times. The noise floor
  // (Note [When the shares change]) keeps the split; a rank at half speed moves it anyway.
  std::vector<std::vector<double>> noise;
  for (int k = 0; k < 23; ++k) {
    const double a = k % 5 == 0 ? 1.25 : k % 7 == 0 ? 0.85 : 1.0;
    const double b = k % 3 == 0 ? 1.2 : k % 11 == 0 ? 0.8 : 1.0;
    noise.push_back({a, b});
  }
  SharePolicy equal(automatic(64, {32, 32}));
  CHECK(run(equal, 1, 400, {0.13, 0.13}, noise).empty());
  SharePolicy half(automatic(64, {32, 32}));
  CHECK_FALSE(run(half, 1, 40, {0.13, 0.26}, noise).empty());
  CHECK(half.shares()[0] > half.shares()[1]);
}

TEST_CASE("the split follows a drift, but not sooner than the minimum interval", "[balance]") {
  SharePolicy b(automatic(120, {60, 60}));
  REQUIRE(run(b, 1, 10, {1.0, 1.0}).empty());
  // Rank 0 gets a busy neighbour at step 11: half speed.
  const std::vector<int64_t> changes = run(b, 11, 60, {2.0, 1.0});
  REQUIRE_FALSE(changes.empty());
  // The means cross the 5 % gain, and the noise floor the mixed window raises, within a few steps.
  CHECK(changes.front() <= 20);
  for (size_t k = 1; k < changes.size(); ++k) CHECK(changes[k] - changes[k - 1] >= 10);
  CHECK(std::abs(b.shares()[0] - 40) <= 1);  // 1:2, within the image a change must gain more than
  // The neighbour leaves: back to even, or within one image of it (closer is not worth
  // the 5 % a change must gain).
  run(b, 71, 60, {1.0, 1.0});
  CHECK(std::abs(b.shares()[0] - 60) <= 1);
  CHECK(b.changes() >= 3);
}

TEST_CASE("ties and proportions: integer shares summing to the global batch", "[balance]") {
  // 1 : 1 : 0.5 of 10 images.
  SharePolicy three(automatic(10, {4, 3, 3}));
  run(three, 1, 20, {1.0, 1.0, 2.0});
  CHECK(three.shares() == Shares{4, 4, 2});
  // Equal speeds, an odd global batch: torch.chunk's 3,2 is already the best split.
  SharePolicy equal(automatic(5, {3, 2}));
  CHECK(run(equal, 1, 30, {1.0, 1.0}).empty());
}

TEST_CASE("a hopeless rank gets no images, unless SyncBatchNorm needs it in every forward", "[balance]") {
  // Rank 2 needs 50 ms per image; ranks 0 and 1 do all 16 images in 8 ms.
  SharePolicy b(automatic(16, {6, 5, 5}));
  run(b, 1, 10, {1.0, 1.0, 50.0});
  CHECK(b.shares() == Shares{8, 8, 0});
  BalanceOptions sync_bn = automatic(16, {6, 5, 5});
  sync_bn.allow_empty_share = false;
  SharePolicy kept(sync_bn);
  std::optional<ShareChange> change;
  for (int64_t step = 1; step < 10 && !change; ++step) change = kept.observe(step, measured(kept.shares(), {1.0, 1.0, 50.0}));
  REQUIRE(change);
  CHECK(change->after == Shares{8, 7, 1});
  CHECK(change->hopeless.empty());
  // The change that left rank 2 out names it.
  SharePolicy named(automatic(16, {6, 5, 5}));
  std::optional<ShareChange> out;
  for (int64_t step = 1; step < 10 && !out; ++step) out = named.observe(step, measured(named.shares(), {1.0, 1.0, 50.0}));
  REQUIRE(out);
  CHECK(out->hopeless == std::vector<int>{2});
  // Never rank 0: every rank takes its BatchNorm statistics.
  SharePolicy first(automatic(16, {6, 5, 5}));
  run(first, 1, 10, {50.0, 1.0, 1.0});
  CHECK(first.shares()[0] >= 1);
  // A rank that is slow but still worth an image keeps one.
  SharePolicy slow(automatic(16, {6, 5, 5}));
  run(slow, 1, 10, {1.0, 1.0, 4.0});
  CHECK(slow.shares()[2] >= 1);
}

TEST_CASE("steps with a new shape and unmeasured ranks are skipped", "[balance]") {
  SharePolicy b(automatic(90, {45, 45}));
  // A rank that could not measure (a GPU whose marks are not passed yet) holds the decision.
  for (int64_t step = 1; step < 20; ++step) {
    CHECK_FALSE(b.observe(step, {{-1, 45}, {90'000'000, 45}}));
  }
  CHECK(b.measured_steps() == 0);
  // No exchange yet (the first step): nothing.
  CHECK_FALSE(b.observe(20, {}));
  // Alternating shapes (each step's counts differ from the last) are never measured.
  for (int64_t step = 21; step < 40; ++step) {
    const int64_t a = step % 2 == 0 ? 44 : 46;
    CHECK_FALSE(b.observe(step, {{a * 1'000'000, a}, {(90 - a) * 2'000'000, 90 - a}}));
  }
  CHECK(b.measured_steps() == 0);
}

TEST_CASE("static shares never move; the summary's estimate compares them with the even split", "[balance]") {
  BalanceOptions o;
  o.global_batch = 90;
  o.initial_shares = {60, 30};
  o.automatic = false;
  SharePolicy b(o);
  CHECK(run(b, 1, 30, {1.0, 2.0}).empty());
  CHECK(b.shares() == Shares{60, 30});
  // 27 measured steps (one new shape, two warm-up): 60 ms each; the even split 45 x 2 ms.
  // (Measured steps count from the warm-up's end, without waiting for a window.)
  CHECK(b.measured_steps() == 27);
  CHECK(b.measured_seconds() == Approx(27 * 0.060));
  CHECK(b.even_split_seconds() == Approx(27 * 0.090));
}

TEST_CASE("every rank computes the same shares from the same figures", "[balance]") {
  // The balancer holds no clock and no randomness: two instances fed the same reports agree
  // at every step, also on awkward speeds.
  SharePolicy a(automatic(1000, {334, 333, 333}));
  SharePolicy b(automatic(1000, {334, 333, 333}));
  const std::vector<double> speeds = {1.0 / 3.0, 0.7, 0.1 * std::sqrt(2.0)};
  for (int64_t step = 1; step < 200; ++step) {
    const auto ra = measured(a.shares(), speeds, {1.0 + 0.01 * static_cast<double>(step % 7), 1.0, 1.0});
    const auto ca = a.observe(step, ra);
    const auto cb = b.observe(step, ra);
    REQUIRE(ca.has_value() == cb.has_value());
    REQUIRE(a.shares() == b.shares());
  }
}

TEST_CASE("bad initial shares and --balance texts are refused, saying what was expected", "[balance]") {
  CHECK_THROWS_WITH(SharePolicy(automatic(10, {4, 4})), Contains("summing to the global batch 10") &&
                                                              Contains("found 4,4"));
  CHECK_THROWS_WITH(SharePolicy(automatic(10, {11, -1})), Contains("expected shares >= 0, found -1"));
  CHECK(parse_balance("even").kind == BalanceSpec::Kind::kEven);
  CHECK(parse_balance("auto").kind == BalanceSpec::Kind::kAuto);
  const BalanceSpec s = parse_balance("static:3,1");
  CHECK(s.kind == BalanceSpec::Kind::kStatic);
  CHECK(s.shares == Shares{3, 1});
  CHECK_THROWS_WITH(parse_balance("fast"), Contains("expected even, auto or static:N0,N1") && Contains("'fast'"));
  CHECK_THROWS_WITH(parse_balance("static:3,x"), Contains("--balance static") && Contains("x"));
  CHECK_THROWS_WITH(parse_balance("static:"), Contains("--balance static"));
  CHECK_THROWS_WITH(parse_balance("static:3,-1"), Contains("--balance static"));
  CHECK(format_shares({171, 85}) == "171,85");
}
