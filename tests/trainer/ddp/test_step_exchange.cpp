// StepExchange (trainer/ddp/step_exchange.h): the split of the ranks' waits, the records of two
// ranks on threads over real Gloo groups (with a Reducer, as the loop drives them), the
// exchange's place in the step and what a mixed placement does, and a world of one.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "tests/support/scoped_env.h"
#include "tests/trainer/ddp/reducer_ranks.h"
#include "tests/trainer/run_process.h"
#include "trainer/ddp/step_exchange.h"

using Catch::Matchers::Contains;
using namespace mtrain;

using mtrain::testing::gradients;
using mtrain::testing::GlooRank;
using mtrain::testing::on_two_ranks;
using mtrain::testing::random_input;
using mtrain::testing::three_linears;

TEST_CASE("every rank's wait: per-rank sums, the slowest rank of each step, the communication none hid",
          "[exchange]") {
  // Note [Every rank's wait] in trainer/ddp/step_exchange.cpp.
  RankWaits w;
  CHECK(w.mean_wait_seconds() == 0.0);
  CHECK_THAT(describe_rank_waits(w), Contains("no step's waits"));
  w.add_step({0.30, 0.02, 0.10});  // rank 1 finished backward last
  w.add_step({0.05, 0.25, 0.01});  // rank 2
  w.add_step({0.20, 0.03, 0.40});  // rank 1 again
  CHECK(w.steps == 3);
  CHECK(w.wait_seconds[0] == Approx(0.55));
  CHECK(w.wait_seconds[1] == Approx(0.30));
  CHECK(w.wait_seconds[2] == Approx(0.51));
  CHECK(w.slowest_steps == std::vector<int64_t>{0, 2, 1});
  CHECK(w.exposed_seconds == Approx(0.06));
  CHECK(w.mean_wait_seconds() == Approx(1.36 / 9));
  // 0.151 s per step: 0.020 s of it communication, 0.131 s the slowest rank.
  CHECK(describe_rank_waits(w) ==
        "after backward the 3 ranks waited 0.151 s per step on average over 3 steps: 0.020 s for communication "
        "that no rank hid, 0.131 s for the slowest rank to finish its backward (slowest: rank 1 in 2 steps, rank 2 "
        "in 1)");
  // Ties go to the lowest rank; a step with another world size is a bug.
  w.add_step({0.0, 0.0, 0.0});
  CHECK(w.slowest_steps == std::vector<int64_t>{1, 2, 1});
  CHECK_THROWS_WITH(w.add_step({0.1, 0.2}), Contains("2 ranks, earlier steps 3"));

  RankWaits many;
  for (int r = 0; r < 5; ++r) {
    std::vector<double> waits(5, 1.0);
    waits[static_cast<size_t>(r)] = 0.0;
    for (int k = 0; k <= r; ++k) many.add_step(waits);
  }
  CHECK_THAT(describe_rank_waits(many),
             Contains("(slowest: rank 4 in 5 steps, rank 3 in 4, rank 2 in 3, 2 more ranks in 3)"));
  RankWaits one;
  one.add_step({0.2, 0.1});
  CHECK_THAT(describe_rank_waits(one), Contains("over 1 step: ") && Contains("(slowest: rank 1 in 1 step)"));
}

TEST_CASE("two ranks: the one that sleeps before its backward is the slowest, and its peer waits for it",
          "[exchange]") {
  // Real Gloo groups on two threads. Rank 1 sleeps 100 ms before each backward, so rank 0
  // waits about that long after its own, every step (less whatever delays rank 0's own
  // backward: the check allows half); rank 1 waits only for the transfers. The first step's
  // waits travel with the second step's exchange, so four steps report three.
  constexpr int kSteps = 4;
  constexpr auto kSleep = std::chrono::milliseconds(100);
  std::vector<RankWaits> seen(2);
  std::vector<double> own_wait(2, 0.0);
  const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
    GlooRank rank(r, store);
    auto& model = rank.model;
    Reducer& reducer = rank.reducer;
    for (int s = 0; s < kSteps; ++s) {
      const Tensor x = random_input(4);
      const Tensor y = model->forward(x);
      const MicroBatchInfo info{4, true};
      reducer.before_backward(info);
      rank.exchange.issue({}, info, reducer.last_wait_ns());
      if (r == 1) std::this_thread::sleep_for(kSleep);
      model->backward(Tensor::full(y.shape(), 0.25f));
      reducer.after_backward();
      rank.exchange.finish();
      if (s < kSteps - 1) own_wait[static_cast<size_t>(r)] += reducer.last_step().wait_seconds;
    }
    seen[static_cast<size_t>(r)] = rank.exchange.rank_waits();
  });
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].empty());
    const RankWaits& w = seen[r];
    CHECK(w.steps == kSteps - 1);
    CHECK(w.slowest_steps == std::vector<int64_t>{0, kSteps - 1});
    // Every rank holds the same figures, and each rank's figure is what it measured.
    CHECK(w.wait_seconds == seen[0].wait_seconds);
    CHECK(w.wait_seconds[r] == Approx(own_wait[r]).margin(1e-8));
  }
  const RankWaits& w = seen[0];
  CHECK(w.wait_seconds[0] >= 0.5 * 0.1 * (kSteps - 1));
  CHECK(w.exposed_seconds == Approx(w.wait_seconds[1]));
  CHECK(w.wait_seconds[1] < w.wait_seconds[0]);
}

namespace {

// One synchronized micro-batch of `rank`, as the loop runs it with the exchange issued before
// the backward (the CPU's place) or after it (a GPU's): its backward, or its skip when the
// rank holds no samples.
void exchange_around_backward(GlooRank& rank, const StepReport& mine, bool issue_before, bool empty) {
  const MicroBatchInfo info{empty ? 0 : 4, true};
  Tensor y;
  if (!empty) y = rank.model->forward(random_input(4));
  rank.reducer.before_backward(info);
  if (issue_before) rank.exchange.issue(mine, info, rank.reducer.last_wait_ns());
  if (empty) {
    rank.reducer.skip_backward();
  } else {
    rank.model->backward(Tensor::full(y.shape(), 0.25f));
  }
  if (!issue_before) rank.exchange.issue(mine, info, rank.reducer.last_wait_ns());
  rank.reducer.after_backward();
  rank.exchange.finish();
}

}  // namespace

TEST_CASE("every rank reads the same records whether the exchange goes before or after the backward",
          "[exchange]") {
  // Note [The exchange's place in the step]: the CPU issues before the backward, a GPU after
  // it; every rank at the same point, since on Gloo the exchange and the buckets share one
  // group. Rank 1 sends a vote, both a compute time; both read the same.
  const bool before = GENERATE(true, false);
  INFO((before ? "issued before the backward" : "issued after the backward"));
  std::vector<int64_t> agreed(2, -1);
  std::vector<std::vector<RankCompute>> computes(2);
  std::vector<char> shared_group(2, 0);  // not vector<bool>: each thread writes its own element
  const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
    GlooRank rank(r, store);
    shared_group[static_cast<size_t>(r)] = rank.groups.control == rank.groups.gradients;
    exchange_around_backward(rank, {r == 1 ? 77 : 0, RankCompute{1000 + r, 4}}, before, false);
    agreed[static_cast<size_t>(r)] = rank.exchange.agreed_stop_vote();
    computes[static_cast<size_t>(r)] = rank.exchange.ranks_compute();
  });
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].empty());
    CHECK(shared_group[r]);  // the case the placement exists for
    CHECK(agreed[r] == 77);
    REQUIRE(computes[r].size() == 2);
    CHECK(computes[r][1].nanoseconds == 1001);
    CHECK(computes[r][0].images == 4);
  }
  // The place is the device's alone.
  CHECK_FALSE(StepExchange(nullptr, Device::cpu()).issued_after_backward());
  CHECK(StepExchange(nullptr, Device::cuda(0)).issued_after_backward());
}

TEST_CASE("a rank with an empty micro-batch keeps its collectives in its peers' order", "[exchange]") {
  // Note [The exchange's place in the step]. Rank 0 runs a backward; rank 1 holds no samples and
  // skips it. Both issue at the same point, before or after. Were rank 1 to issue the exchange
  // and the buckets in another order than rank 0, their collectives would not match.
  const bool before = GENERATE(true, false);
  INFO((before ? "issued before the backward" : "issued after the backward"));
  // Each rank scales its bucket by 1/2 and rank 1 adds zeros: rank 0's gradient for dy / 2.
  auto reference = three_linears();
  reference->zero_grad();
  reference->forward(random_input(4));
  reference->backward(Tensor::full({4, 100}, 0.125f));
  const auto expected = gradients(*reference);

  std::vector<std::vector<std::vector<float>>> got(2);
  std::vector<int64_t> agreed(2, -1);
  const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
    GlooRank rank(r, store);
    rank.reducer.zero_gradients();
    const bool empty = r == 1;
    exchange_around_backward(rank, {empty ? 5 : 0, RankCompute{}}, before, empty);
    got[static_cast<size_t>(r)] = gradients(*rank.model);
    agreed[static_cast<size_t>(r)] = rank.exchange.agreed_stop_vote();
  });
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].empty());
    CHECK(got[r] == expected);
    CHECK(agreed[r] == 5);
  }
}

// The hidden case below runs in a child process: on one Gloo group, a mixed placement pairs
// one rank's all-gather with the other's all-reduce, which Gloo may answer by aborting the
// process.
namespace {
constexpr const char* kMixedChild = "MTRAIN_TEST_MIXED_PLACEMENT_CHILD";
}  // namespace

TEST_CASE("mixed placement child: rank 0 issues before its backward and rank 1 after", "[.mixed-placement-child]") {
  if (std::getenv(kMixedChild) == nullptr) return;  // run by hand it would only wait for its timeout
  const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
    GlooRank rank(r, store, ReducerOptions{}, Millis(3000));
    exchange_around_backward(rank, {}, r == 0, false);
  });
  for (const std::string& e : errors) {
    INFO(e);
    CHECK(e.empty());
  }
}

TEST_CASE("ranks that place the exchange differently do not complete the step", "[exchange]") {
  // Note [The exchange's place in the step]: why one unit decides the place for every rank.
  // The child either ends with an error from the mismatched collectives or is aborted by Gloo;
  // it must not finish the step as if nothing had happened.
  mtrain::testing::ScopedEnv env(kMixedChild, "1");
  const auto result = mtrain::testing::run_process(std::filesystem::read_symlink("/proc/self/exe").string(),
                                                   {"mixed placement child: rank 0 issues before its backward and "
                                                    "rank 1 after"});
  INFO(result.out << result.err);
  CHECK(result.exit_code != 0);
  // Not a test-binary mishap: the mismatched collectives failed (on Gloo each rank's waits for
  // a peer that is in another operation, until the timeout), or Gloo ended the process.
  CHECK((result.exit_code == -1 || Contains("in group 'world' timed out").match(result.out)));
}

TEST_CASE("a world of one reads its own record; every synchronized micro-batch sends exactly one", "[exchange]") {
  StepExchange local(nullptr, Device::cpu());
  CHECK(local.agreed_stop_vote() == 0);
  CHECK(local.ranks_compute().empty());
  MicroBatchInfo info{8, true};
  local.issue({42, RankCompute{5000, 8}}, info, -1);
  CHECK_THROWS_WITH(local.issue({}, info, -1), Contains("issued twice"));
  local.finish();
  CHECK(local.agreed_stop_vote() == 42);
  REQUIRE(local.ranks_compute().size() == 1);
  CHECK(local.ranks_compute()[0].nanoseconds == 5000);
  CHECK(local.rank_waits().steps == 0);  // not measured: -1
  CHECK_THROWS_WITH(local.finish(), Contains("without the step exchange"));
  CHECK_THROWS_WITH(local.issue({}, MicroBatchInfo{8, false}, -1), Contains("synchronized micro-batch only"));
  // A measured wait is summed even in a world of one, and the planned total is checked.
  info.world_samples = 8;
  local.issue({}, info, 2'000'000);
  local.finish();
  CHECK(local.rank_waits().steps == 1);
  CHECK(local.rank_waits().wait_seconds[0] == Approx(0.002));
  info.world_samples = 9;
  local.issue({}, info, -1);
  CHECK_THROWS_WITH(local.finish(), Contains("held 8 images together (8 by rank)") && Contains("has 9"));
}
