// Reducer (trainer/ddp/reducer.h) and learning-rate schedules in one process: bucket
// layout, the no_sync path, the hook contract, and that a group of one leaves the
// gradients exactly as local training does. Several ranks are covered end to end by
// test_distributed_train.
#include <catch2/catch.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <memory>
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/solo_group.h"
#include "tests/trainer/counting_group.h"
#include "collectives/process_group.h"
#include "collectives/store.h"
#include "core/error.h"
#include "models/init.h"
#include "models/linear.h"
#include "models/sequential.h"
#include "models/zoo.h"
#include "trainer/loop/lr_schedule.h"
#include "trainer/ddp/rank_consensus.h"
#include "trainer/ddp/reducer.h"
#include "trainer/ddp/training_groups.h"

using Catch::Matchers::Contains;
using namespace mtrain;

namespace {

using mtrain::testing::CountingGroup;
using mtrain::testing::SoloGroup;

// Three Linear(100, 100): weights of 40,000 bytes, biases of 400.
std::unique_ptr<models::Sequential> three_linears() {
  auto m = std::make_unique<models::Sequential>();
  for (int i = 0; i < 3; ++i) m->append(std::make_unique<models::Linear>(100, 100));
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  for (auto& p : m->parameters()) {
    float* v = p.param->value.data<float>();
    for (int64_t k = 0; k < p.param->value.numel(); ++k) v[k] = 0.1f * normal(gen);
  }
  return m;
}

// One of two ranks training three_linears() with a Reducer over real Gloo groups (10 s
// timeouts); the groups outlive the reducer.
struct GlooRank {
  GlooRank(int rank, std::shared_ptr<Store> store, ReducerOptions o = {})
      : groups(create_training_groups("gloo", std::move(store), rank, 2, Device::cpu(), ten_seconds())),
        model(three_linears()),
        reducer(groups.gradients, o, groups.control) {
    reducer.attach(*model);
  }
  static ProcessGroupOptions ten_seconds() {
    ProcessGroupOptions options;
    options.timeout = Millis(10000);
    return options;
  }

  const TrainingGroups groups;
  std::unique_ptr<models::Sequential> model;
  Reducer reducer;
};

Tensor random_input(int64_t rows) {
  Tensor x = Tensor::empty({rows, 100});
  std::mt19937 gen(11);
  std::normal_distribution<float> normal;
  for (int64_t k = 0; k < x.numel(); ++k) x.data<float>()[k] = normal(gen);
  return x;
}

std::vector<std::vector<float>> gradients(models::Module& m) {
  std::vector<std::vector<float>> out;
  for (auto& p : m.parameters()) out.push_back(p.param->grad.to_vector<float>());
  return out;
}

// One forward and backward of `m` with `sync` around the backward, in a world of one.
void step(models::Module& m, GradientSynchronizer& sync, bool synchronize) {
  const Tensor x = random_input(4);
  const Tensor y = m.forward(x);
  MicroBatchInfo info{4, synchronize};
  info.world_samples = 4;
  sync.before_backward(info);
  m.backward(Tensor::full(y.shape(), 0.25f));
  sync.report({});
  sync.after_backward();
}

// Runs body(rank, store) for ranks 0 and 1 on two threads, each with its own client of
// one store server (10 s timeouts), as two processes would; returns what each rank
// threw ("" when it returned).
std::vector<std::string> on_two_ranks(const std::function<void(int, std::shared_ptr<Store>)>& body) {
  TcpStoreServer server("127.0.0.1", 0, "token");
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        body(r, std::make_shared<TcpStore>("127.0.0.1", server.port(), "token", Millis(10000)));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  return errors;
}

}  // namespace

TEST_CASE("host values travel on the control group, gradient buckets on the gradient group", "[reducer]") {
  // Note [Control-plane collectives] in trainer/ddp/training_groups.cpp: with NCCL the two
  // are different groups, and NCCL would refuse the host tensors.
  SoloGroup solo_gradients;
  SoloGroup solo_control;
  auto gradients_group = std::make_shared<CountingGroup>(solo_gradients.group);
  auto control_group = std::make_shared<CountingGroup>(solo_control.group);
  auto model = three_linears();
  ReducerOptions o;
  o.first_bucket_bytes = 1000;
  o.bucket_cap_bytes = 50000;
  o.weight_by_sample_count = true;
  Reducer reducer(gradients_group, o, control_group);
  reducer.attach(*model);
  // The layout check: the item count, then the hashes.
  CHECK(control_group->allgathers == 2);
  CHECK(gradients_group->allgathers == 0);

  auto reference = three_linears();
  LocalGradients local;
  local.attach(*reference);
  step(*reference, local, true);
  step(*model, reducer, true);
  CHECK(gradients(*model) == gradients(*reference));
  CHECK(gradients_group->allreduces == 4);  // one per bucket
  // The sample counts travel with the stop votes and the waits (Note [Reducer gradient
  // weighting]): nothing blocks between forward and backward.
  CHECK(control_group->allreduces == 0);
  CHECK(control_group->allgathers == 3);
  CHECK(gradients_group->broadcasts + control_group->broadcasts == 0);
  CHECK(gradients_group->others + control_group->others == 0);
  CHECK_FALSE(reducer.last_step().waited_on_device);  // host buckets are awaited on the host
  CHECK_THAT(reducer.describe(), Contains("4 buckets on cpu"));
}

TEST_CASE("buckets: reverse parameter order, a small first bucket, then the cap", "[reducer]") {
  SoloGroup solo;
  auto model = three_linears();
  ReducerOptions o;
  o.first_bucket_bytes = 1000;
  o.bucket_cap_bytes = 50000;
  Reducer reducer(solo.group, o);
  reducer.attach(*model);
  // Parameters: 0 = 0.weight, 1 = 0.bias, ..., 5 = 2.bias. The first bucket takes only
  // 2.bias (2.weight would overflow 1000 bytes); later ones fill up to 50,000 bytes, and
  // 0.weight overflows the third into a fourth.
  CHECK(reducer.bucket_parameters() == std::vector<std::vector<int>>{{5}, {4, 3}, {2, 1}, {0}});
  CHECK_THAT(reducer.describe(), Contains("6 parameter tensors in 4 buckets"));
}

TEST_CASE("a group of one leaves the gradients exactly as local training does", "[reducer]") {
  SoloGroup solo;
  auto local_model = three_linears();
  auto ddp_model = three_linears();
  LocalGradients local;
  local.attach(*local_model);
  ReducerOptions o;
  o.first_bucket_bytes = 1000;
  o.bucket_cap_bytes = 50000;
  Reducer reducer(solo.group, o);
  reducer.attach(*ddp_model);

  step(*local_model, local, true);
  step(*ddp_model, reducer, true);
  CHECK(gradients(*ddp_model) == gradients(*local_model));
  // Every bucket launched, in index order, the first while gradients were outstanding.
  const auto& launches = reducer.last_step().launches;
  REQUIRE(launches.size() == 4);
  for (int k = 0; k < 4; ++k) CHECK(launches[k].bucket == k);
  CHECK(launches[0].params_pending > 0);
  CHECK(launches[3].params_pending == 0);
  CHECK(reducer.totals().synced_steps == 1);

  // no_sync: gradients accumulate, nothing is launched; the next synced step reduces the sum.
  step(*local_model, local, false);
  step(*ddp_model, reducer, false);
  CHECK(reducer.last_step().launches.empty());
  CHECK(reducer.totals().synced_steps == 1);
  step(*local_model, local, true);
  step(*ddp_model, reducer, true);
  CHECK(gradients(*ddp_model) == gradients(*local_model));
  CHECK(reducer.totals().synced_steps == 2);
}

TEST_CASE("the hidden share of the all-reduce is 1 - wait / span, clamped", "[reducer]") {
  const auto hidden = [](double wait, double span) {
    mtrain::ReducerTotals t;
    t.wait_seconds = wait;
    t.comm_span_seconds = span;
    return t.hidden_fraction();
  };
  CHECK(hidden(0.25, 1.0) == Approx(0.75));  // a quarter of the span was waited for
  CHECK(hidden(0.0, 2.0) == 1.0);            // all of it behind backward
  CHECK(hidden(3.0, 2.0) == 0.0);            // waited longer than the span: none hidden
  CHECK(hidden(0.5, 0.0) == 0.0);            // nothing reduced
}

TEST_CASE("every rank's wait: per-rank sums, the slowest rank of each step, the communication none hid",
          "[reducer]") {
  // Note [Every rank's wait] in trainer/ddp/reducer.cpp.
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
          "[reducer]") {
  // Real Gloo groups on two threads. Rank 1 sleeps 100 ms before each backward, so rank 0
  // waits about that long after its own, every step (less whatever delays rank 0's own
  // backward: the check allows half); rank 1 waits only for the transfers. The first step's waits travel with the second step's exchange, so four
  // steps report three.
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
      reducer.before_backward({4, true});
      if (r == 1) std::this_thread::sleep_for(kSleep);
      model->backward(Tensor::full(y.shape(), 0.25f));
      reducer.report({});
      reducer.after_backward();
      if (s < kSteps - 1) own_wait[static_cast<size_t>(r)] += reducer.last_step().wait_seconds;
    }
    seen[static_cast<size_t>(r)] = reducer.rank_waits();
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

TEST_CASE("zero_gradients clears every gradient: the reducer through its buckets, local training through the model",
          "[reducer]") {
  SoloGroup solo;
  auto local_model = three_linears();
  auto ddp_model = three_linears();
  LocalGradients local;
  CHECK_THROWS_AS(local.zero_gradients(), InternalError);  // before attach
  local.attach(*local_model);
  ReducerOptions o;
  o.first_bucket_bytes = 1000;
  o.bucket_cap_bytes = 50000;
  Reducer reducer(solo.group, o);
  CHECK_THROWS_AS(reducer.zero_gradients(), InternalError);
  reducer.attach(*ddp_model);
  const auto zeros = [](models::Module& m) {
    for (auto& p : m.parameters()) {
      for (float v : p.param->grad.to_vector<float>()) {
        if (v != 0.0f) return false;
      }
    }
    return true;
  };
  for (int round = 0; round < 2; ++round) {
    step(*local_model, local, true);
    step(*ddp_model, reducer, true);
    REQUIRE_FALSE(zeros(*ddp_model));
    local.zero_gradients();
    reducer.zero_gradients();
    CHECK(zeros(*local_model));
    CHECK(zeros(*ddp_model));
  }
  // A step after the fill equals a step from fresh gradients.
  step(*local_model, local, true);
  step(*ddp_model, reducer, true);
  CHECK(gradients(*ddp_model) == gradients(*local_model));
  // A gradient that no longer lives in its bucket (or arena) would keep its values: refused.
  ddp_model->parameters().front().param->grad = Tensor::zeros({100, 100});
  CHECK_THROWS_WITH(reducer.zero_gradients(), Contains("the gradient of 0.weight is no longer a view into the flat"));
  for (const auto& p : local_model->parameters()) {
    CHECK(p.param->grad.shares_storage_with(local_model->parameters().front().param->grad));
  }
  local_model->parameters().back().param->grad = Tensor::zeros({100});
  CHECK_THROWS_WITH(local.zero_gradients(), Contains("the gradient of 2.bias is no longer a view into the flat"));
}

TEST_CASE("a report reaches every rank whether it is issued before or after the backward", "[reducer]") {
  // Note [The loss is read after backward is queued]: the CPU reports before the backward,
  // a GPU after it; every rank at the same point, since the exchange and the buckets may
  // share one group. Rank 1 reports a vote, both a compute time; both read the same.
  const bool before = GENERATE(true, false);
  INFO((before ? "reported before the backward" : "reported after the backward"));
  std::vector<int64_t> agreed(2, -1);
  std::vector<std::vector<RankCompute>> computes(2);
  const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
    GlooRank rank(r, store);
    auto& model = rank.model;
    Reducer& reducer = rank.reducer;
    const Tensor y = model->forward(random_input(4));
    reducer.before_backward({4, true});
    const StepReport mine{r == 1 ? 77 : 0, RankCompute{1000 + r, 4}};
    if (before) reducer.report(mine);
    model->backward(Tensor::full(y.shape(), 0.25f));
    if (!before) reducer.report(mine);
    reducer.after_backward();
    agreed[static_cast<size_t>(r)] = reducer.agreed_stop_vote();
    computes[static_cast<size_t>(r)] = reducer.ranks_compute();
  });
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].empty());
    CHECK(agreed[r] == 77);
    REQUIRE(computes[r].size() == 2);
    CHECK(computes[r][1].nanoseconds == 1001);
    CHECK(computes[r][0].images == 4);
  }

  // A synchronized micro-batch is reported exactly once; one that is not needs no report.
  SoloGroup solo;
  auto model = three_linears();
  Reducer reducer(solo.group, ReducerOptions{});
  reducer.attach(*model);
  Tensor y = model->forward(random_input(4));
  reducer.before_backward({4, true});
  model->backward(Tensor::full(y.shape(), 0.25f));
  CHECK_THROWS_WITH(reducer.after_backward(), Contains("without report()"));
  y = model->forward(random_input(4));
  reducer.before_backward({4, true});
  reducer.report({});
  CHECK_THROWS_WITH(reducer.report({}), Contains("report() twice"));
  model->backward(Tensor::full(y.shape(), 0.25f));
  reducer.after_backward();
  y = model->forward(random_input(4));
  reducer.before_backward({4, false});
  model->backward(Tensor::full(y.shape(), 0.25f));
  CHECK_NOTHROW(reducer.after_backward());
}

TEST_CASE("a rank with an empty micro-batch issues its collectives in its peers' order", "[reducer]") {
  // Note [The loss is read after backward is queued]: on Gloo the exchange and the buckets
  // share one group. Rank 0 runs a backward; rank 1 holds no samples and skips it. Both report
  // at the same point, before or after. Were rank 1 to issue the exchange and the buckets in
  // another order than rank 0, their collectives would not match (an error, or the 10 s
  // timeout).
  const bool before = GENERATE(true, false);
  INFO((before ? "reported before the backward" : "reported after the backward"));
  // Each rank scales its bucket by 1/2 and rank 1 adds zeros: rank 0's gradient for dy / 2.
  auto reference = three_linears();
  const Tensor x = random_input(4);
  reference->zero_grad();
  reference->forward(x);
  reference->backward(Tensor::full({4, 100}, 0.125f));
  const auto expected = gradients(*reference);

  std::vector<std::vector<std::vector<float>>> got(2);
  std::vector<int64_t> agreed(2, -1);
  const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
    GlooRank rank(r, store);
    auto& model = rank.model;
    Reducer& reducer = rank.reducer;
    reducer.zero_gradients();
    const bool empty = r == 1;
    if (!empty) model->forward(x);
    reducer.before_backward({empty ? 0 : 4, true});
    const StepReport mine{empty ? 5 : 0, RankCompute{}};
    if (before) reducer.report(mine);
    if (empty) {
      reducer.skip_backward();
    } else {
      model->backward(Tensor::full({4, 100}, 0.25f));
    }
    if (!before) reducer.report(mine);
    reducer.after_backward();
    got[static_cast<size_t>(r)] = gradients(*model);
    agreed[static_cast<size_t>(r)] = reducer.agreed_stop_vote();
  });
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].empty());
    CHECK(got[r] == expected);
    CHECK(agreed[r] == 5);
  }
}

TEST_CASE("a parameter whose gradient never arrives is named", "[reducer]") {
  SoloGroup solo;
  auto model = three_linears();
  Reducer reducer(solo.group, ReducerOptions{});
  reducer.attach(*model);
  reducer.before_backward({4, true});
  // No backward ran: no hook fired.
  reducer.report({});
  CHECK_THROWS_WITH(reducer.after_backward(), Contains("parameter 0.weight reported its gradient ready 0 times"));
}

TEST_CASE("an empty micro-batch still takes part in the exchange", "[reducer]") {
  SoloGroup solo;
  auto model = three_linears();
  Reducer reducer(solo.group, ReducerOptions{});
  reducer.attach(*model);
  model->zero_grad();
  // No backward runs for an empty micro-batch; skipping it launches every bucket.
  reducer.before_backward({0, true});
  reducer.report({});
  CHECK(reducer.last_step().launches.empty());
  reducer.skip_backward();
  CHECK(reducer.last_step().launches.size() == reducer.bucket_parameters().size());
  reducer.after_backward();
  for (const auto& g : gradients(*model)) CHECK(g == std::vector<float>(g.size(), 0.0f));
  // A skip is for empty micro-batches only, and an empty one must be skipped.
  reducer.before_backward({4, true});
  CHECK_THROWS_WITH(reducer.skip_backward(), Contains("holds samples"));
  reducer.before_backward({0, true});
  reducer.report({});
  CHECK_THROWS_WITH(reducer.after_backward(), Contains("reported its gradient ready 0 times"));
  LocalGradients local;
  local.attach(*model);
  local.before_backward({4, true});
  CHECK_THROWS_WITH(local.skip_backward(), Contains("skip_backward for a micro-batch of 4 samples"));
  local.before_backward({0, true});
  local.skip_backward();
  local.report({});
  CHECK_NOTHROW(local.after_backward());

  // Weighted by sample counts, a world whose global micro-batch is empty is an error.
  ReducerOptions weighted;
  weighted.weight_by_sample_count = true;
  Reducer by_count(solo.group, weighted);
  by_count.attach(*model);
  MicroBatchInfo empty_world{0, true};
  empty_world.world_samples = 0;
  CHECK_THROWS_WITH(by_count.before_backward(empty_world), Contains("total 0 samples"));
  // And one that does not say how many samples the world holds is a defect of the caller.
  CHECK_THROWS_AS(by_count.before_backward({4, true}), InternalError);
}

TEST_CASE("weighted by sample count: uneven ranks give the one-process gradient; a split the ranks disagree on "
          "is an error",
          "[reducer]") {
  // Real Gloo groups on two threads: rank 0 holds rows 0-2 of a batch of 4, rank 1 row 3, and each
  // scales its loss gradient as the loop does. Their summed gradient must be one process's on all
  // 4 rows. Then rank 1 plans a step of 5 where the two hold 4: it must stop, naming the counts.
  // The loss is 0.25 x the sum of the outputs, averaged over the rows: dy = 0.25 / rows.
  const Tensor x = random_input(4);
  auto reference = three_linears();
  LocalGradients local;
  local.attach(*reference);
  reference->forward(x);
  local.before_backward({4, true});
  reference->backward(Tensor::full({4, 100}, 0.25f / 4.0f));
  local.report({});
  local.after_backward();
  const auto expected = gradients(*reference);

  std::vector<std::vector<std::vector<float>>> got(2);
  std::vector<std::string> disagreement(2);
  const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
    ReducerOptions o;
    o.weight_by_sample_count = true;
    GlooRank rank(r, store, o);
    auto& model = rank.model;
    Reducer& reducer = rank.reducer;
    const int64_t first = r == 0 ? 0 : 3;
    const int64_t rows = r == 0 ? 3 : 1;
    const auto run_step = [&](int64_t planned) {
      model->zero_grad();
      const std::vector<float> all = x.to_vector<float>();
      model->forward(Tensor::from_vector<float>(
          std::vector<float>(all.begin() + first * 100, all.begin() + (first + rows) * 100), {rows, 100}));
      MicroBatchInfo info{rows, true};
      info.world_samples = planned;
      reducer.before_backward(info);
      // The mean over this rank's rows, scaled as the loop scales it.
      model->backward(Tensor::full({rows, 100}, 0.25f / static_cast<float>(rows) * reducer.loss_gradient_scale()));
      reducer.report({});
      reducer.after_backward();
    };
    run_step(4);
    got[static_cast<size_t>(r)] = gradients(*model);
    try {
      run_step(r == 1 ? 5 : 4);
    } catch (const InternalError& e) {
      disagreement[static_cast<size_t>(r)] = e.what();
    }
  });
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].empty());
    REQUIRE(got[r].size() == expected.size());
    for (size_t k = 0; k < expected.size(); ++k) {
      for (size_t i = 0; i < expected[k].size(); ++i) REQUIRE(got[r][k][i] == Approx(expected[k][i]).margin(1e-6));
    }
  }
  CHECK(disagreement[0].empty());
  CHECK_THAT(disagreement[1], Contains("held 4 images together (3, 1 by rank)") && Contains("has 5") &&
                                  Contains("split the global batch differently"));
}

TEST_CASE("learning-rate schedules: linear scaling, warm-up, step and cosine", "[lr]") {
  LrScheduleOptions o;
  o.base_lr = 0.1;
  o.world_scale = 4;
  o.total_epochs = 10;
  o.warmup_epochs = 2;
  const LrSchedule constant(o);
  CHECK(constant.target_lr() == Approx(0.4));
  CHECK(constant.at(0) == Approx(0.1));   // warm-up starts at the unscaled rate
  CHECK(constant.at(1) == Approx(0.25));  // halfway
  CHECK(constant.at(2) == Approx(0.4));
  CHECK(constant.at(9.5) == Approx(0.4));

  o.warmup_epochs = 0;
  o.kind = LrScheduleKind::Step;
  const LrSchedule step_schedule(o);
  CHECK(step_schedule.at(4.9) == Approx(0.4));
  CHECK(step_schedule.at(5) == Approx(0.04));
  CHECK(step_schedule.at(7.5) == Approx(0.004));
  // A milestone that falls on a step is reached there: --max-steps 724 at 300 steps an
  // epoch, step 362 is epoch 1 + 62/300 of a 724/300-epoch run, which divides to
  // 0.4999999999999999 of it.
  LrScheduleOptions cut = o;
  cut.total_epochs = 724.0 / 300.0;
  CHECK(LrSchedule(cut).at(1.0 + 62.0 / 300.0) == Approx(0.04));
  // With warm-up the milestones stay at 50 % and 75 % of the whole run (epochs 5 and
  // 7.5 of 10), not of the part after warm-up.
  o.warmup_epochs = 2;
  const LrSchedule warm_step(o);
  CHECK(warm_step.at(1) == Approx(0.25));
  CHECK(warm_step.at(4.9) == Approx(0.4));
  CHECK(warm_step.at(5) == Approx(0.04));
  CHECK(warm_step.at(7.5) == Approx(0.004));
  o.warmup_epochs = 0;

  o.kind = LrScheduleKind::Cosine;
  const LrSchedule cosine(o);
  CHECK(cosine.at(0) == Approx(0.4));
  CHECK(cosine.at(5) == Approx(0.2));
  CHECK(cosine.at(10) == Approx(0.0).margin(1e-12));

  CHECK_THROWS_WITH(parse_lr_schedule("linear"), Contains("valid: constant, step, cosine"));
  o.total_epochs = 0;
  CHECK_THROWS_AS(LrSchedule(o), InvalidArgument);
}

TEST_CASE("the replica check names the rank whose parameters differ by one element", "[consensus]") {
  // --check-replicas proves the multi-process tests' replicas identical; here it must
  // fire. Two ranks over real Gloo groups in threads, each with its own mlp built from
  // the same seed; rank 1 nudges one weight by one float step.
  for (const bool nudge : {false, true}) {
    DYNAMIC_SECTION((nudge ? "one element differs" : "identical")) {
      const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
        ProcessGroupOptions options;
        options.timeout = Millis(10000);
        auto group = create_process_group("gloo", store, r, 2, Device::cpu(), options);
        auto model = models::build_model("mlp", 1, 10, {models::InitScheme::kPyTorchDefault, 7});
        if (nudge && r == 1) {
          float& w = model->parameters()[1].param->value.data<float>()[3];
          w = std::nextafter(w, 1e30f);
        }
        const uint64_t h = hash_parameters(*model);
        require_same_on_all_ranks(*group, {{"the parameters", h, "hash"}}, "replica check after step 5: the model");
      });
      for (const std::string& e : errors) {
        INFO(e);
        if (nudge) {
          CHECK_THAT(e, Contains("replica check after step 5: the model differs across ranks") &&
                            Contains("the parameters on rank 1"));
        } else {
          CHECK(e.empty());
        }
      }
    }
  }
}

TEST_CASE("SyncBatchNorm's Gloo group does not queue behind a gradient bucket in flight", "[groups]") {
  // Note [SyncBatchNorm's own group] in trainer/ddp/training_groups.cpp. Rank 0 starts a bucket
  // all-reduce and, before waiting for it, the statistics all-reduce of a BatchNorm
  // layer; rank 1 joins the statistics first and the bucket after. Only on separate
  // groups is each operation's completion independent of the other group's queue. On
  // one group the sequence numbers would pair rank 0's bucket with rank 1's statistics
  // (Gloo aborts the process on the size mismatch; with equal sizes the values would mix).
  std::vector<float> stats_sum(2, 0.0f), bucket_sum(2, 0.0f);
  std::vector<char> separate(2, 0);  // not vector<bool>: each thread writes its own element
  const std::vector<std::string> errors = on_two_ranks([&](int r, std::shared_ptr<Store> store) {
    ProcessGroupOptions options;
    options.timeout = Millis(10000);
    const TrainingGroups groups = create_training_groups("gloo", store, r, 2, Device::cpu(), options);
    const std::shared_ptr<ProcessGroup> stats_group = create_batch_stats_group(groups);
    const bool own_group = stats_group != groups.gradients;
    separate[static_cast<size_t>(r)] = own_group;
    // One group would mispair the operations below and take the test binary down.
    if (!own_group) return;
    Tensor bucket = Tensor::full({1 << 20}, static_cast<float>(r + 1));
    Tensor stats = Tensor::full({8}, static_cast<float>(10 * (r + 1)));
    if (r == 0) {
      const WorkPtr in_flight = groups.gradients->allreduce(bucket, ReduceOp::Sum);
      stats_group->allreduce(stats, ReduceOp::Sum)->wait();
      in_flight->wait();
    } else {
      stats_group->allreduce(stats, ReduceOp::Sum)->wait();
      groups.gradients->allreduce(bucket, ReduceOp::Sum)->wait();
    }
    stats_sum[static_cast<size_t>(r)] = stats.data<float>()[7];
    bucket_sum[static_cast<size_t>(r)] = bucket.data<float>()[(1 << 20) - 1];
  });
  for (size_t r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK(errors[r].empty());
    CHECK(separate[r]);
    CHECK(stats_sum[r] == 30.0f);
    CHECK(bucket_sum[r] == 3.0f);
  }
}

TEST_CASE("a step schedule whose warm-up outlasts its first drop is warned about", "[lr]") {
  std::ostringstream captured;
  const auto previous = spdlog::default_logger();
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(captured)));
  LrScheduleOptions o;
  o.kind = LrScheduleKind::Step;
  o.total_epochs = 4;
  o.warmup_epochs = 1;  // ends before the drop at epoch 2: fine
  const LrSchedule fine(o);
  o.warmup_epochs = 3;  // the drop at epoch 2 comes first
  const LrSchedule late(o);
  spdlog::set_default_logger(previous);
  const std::string log = captured.str();
  CHECK(std::count(log.begin(), log.end(), '\n') == 1);
  CHECK_THAT(log, Contains("comes before the 3-epoch warm-up ends"));
}
