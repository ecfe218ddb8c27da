// Reducer (trainer/ddp/reducer.h) in one process: bucket layout, the no_sync path, the hook
// contract, and that a group of one leaves the gradients exactly as local training does; two
// ranks on threads over real Gloo groups for sample-count weighting, the replica check and
// SyncBatchNorm's group. Several processes are covered end to end by test_distributed_train.
#include <catch2/catch.hpp>
#include <memory>
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/solo_group.h"
#include "tests/trainer/ddp/counting_group.h"
#include "tests/trainer/ddp/reducer_ranks.h"
#include "collectives/process_group.h"
#include "store/store.h"
#include "core/error.h"
#include "models/init.h"
#include "models/linear.h"
#include "models/sequential.h"
#include "models/zoo.h"
#include "trainer/ddp/rank_consensus.h"
#include "trainer/ddp/reducer.h"
#include "trainer/ddp/training_groups.h"

using Catch::Matchers::Contains;
using namespace mtrain;

using mtrain::testing::CountingGroup;
using mtrain::testing::gradients;
using mtrain::testing::GlooRank;
using mtrain::testing::on_two_ranks;
using mtrain::testing::random_input;
using mtrain::testing::SoloGroup;
using mtrain::testing::step;
using mtrain::testing::three_linears;

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
  StepExchange exchange(control_group, Device::cpu());
  step(*reference, local, true);
  step(*model, reducer, true, &exchange);
  CHECK(gradients(*model) == gradients(*reference));
  // A group of one sends no bucket (Note [A group of one reduces nothing]); where buckets
  // travel, they take the gradient group (the next test).
  CHECK(gradients_group->allreduces == 0);
  // The step's exchange goes on the control group too, and the sample counts travel in it
  // with the stop votes and the waits (Note [Reducer gradient weighting]): nothing blocks
  // between forward and backward.
  CHECK(control_group->allreduces == 0);
  CHECK(control_group->allgathers == 3);
  CHECK(gradients_group->broadcasts + control_group->broadcasts == 0);
  CHECK(gradients_group->others + control_group->others == 0);
  CHECK_FALSE(reducer.last_step().waited_on_device);  // host buckets are awaited on the host
  CHECK_THAT(reducer.describe(), Contains("4 buckets on cpu"));
}

TEST_CASE("a group of one sends no bucket unless compressed, and only then is not capturable", "[reducer]") {
  SoloGroup solo_gradients;
  SoloGroup solo_control;
  auto gradients_group = std::make_shared<CountingGroup>(solo_gradients.group);
  auto control_group = std::make_shared<CountingGroup>(solo_control.group);
  ReducerOptions o;
  o.first_bucket_bytes = 1000;
  o.bucket_cap_bytes = 50000;

  auto model = three_linears();
  Reducer alone(gradients_group, o, control_group);
  alone.attach(*model);
  CHECK(alone.capturable());
  step(*model, alone, true);
  CHECK(gradients_group->allreduces == 0);
  CHECK(alone.last_step().launches.size() == 4);  // the bookkeeping stays
  // A replayed graph stands for the backward: every parameter counts as reported once,
  // and nothing is queued, so the gradients stay what the graph left.
  const auto before = gradients(*model);
  alone.before_backward(MicroBatchInfo{4, true});
  alone.backward_replayed();
  alone.after_backward();
  CHECK(gradients(*model) == before);
  CHECK(gradients_group->allreduces == 0);

  ReducerOptions compressed = o;
  compressed.compression = DType::BFloat16;
  auto model16 = three_linears();
  Reducer travels(gradients_group, compressed, control_group);
  travels.attach(*model16);
  CHECK_FALSE(travels.capturable());
  step(*model16, travels, true);
  CHECK(gradients_group->allreduces == 4);  // one per bucket, on the gradient group
  CHECK(control_group->allreduces == 0);
  travels.before_backward(MicroBatchInfo{4, true});
  CHECK_THROWS_AS(travels.backward_replayed(), InternalError);

  ReducerOptions weighted = o;
  weighted.weight_by_sample_count = true;
  auto model_w = three_linears();
  Reducer by_count(gradients_group, weighted, control_group);
  by_count.attach(*model_w);
  CHECK_FALSE(by_count.capturable());

  auto local_model = three_linears();
  LocalGradients local;
  local.attach(*local_model);
  CHECK(local.capturable());
  local.before_backward(MicroBatchInfo{4, true});
  local.backward_replayed();
  local.after_backward();  // throws unless every parameter counts once
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

TEST_CASE("a parameter whose gradient never arrives is named", "[reducer]") {
  SoloGroup solo;
  auto model = three_linears();
  Reducer reducer(solo.group, ReducerOptions{});
  reducer.attach(*model);
  reducer.before_backward({4, true});
  // No backward ran: no hook fired.
  CHECK_THROWS_WITH(reducer.after_backward(), Contains("parameter 0.weight reported its gradient ready 0 times"));
}

TEST_CASE("an empty micro-batch still launches every bucket", "[reducer]") {
  SoloGroup solo;
  auto model = three_linears();
  Reducer reducer(solo.group, ReducerOptions{});
  reducer.attach(*model);
  model->zero_grad();
  // No backward runs for an empty micro-batch; skipping it launches every bucket.
  reducer.before_backward({0, true});
  CHECK(reducer.last_step().launches.empty());
  reducer.skip_backward();
  CHECK(reducer.last_step().launches.size() == reducer.bucket_parameters().size());
  reducer.after_backward();
  for (const auto& g : gradients(*model)) CHECK(g == std::vector<float>(g.size(), 0.0f));
  // A skip is for empty micro-batches only, and an empty one must be skipped.
  reducer.before_backward({4, true});
  CHECK_THROWS_WITH(reducer.skip_backward(), Contains("holds samples"));
  reducer.before_backward({0, true});
  CHECK_THROWS_WITH(reducer.after_backward(), Contains("reported its gradient ready 0 times"));
  LocalGradients local;
  local.attach(*model);
  local.before_backward({4, true});
  CHECK_THROWS_WITH(local.skip_backward(), Contains("skip_backward for a micro-batch of 4 samples"));
  local.before_backward({0, true});
  local.skip_backward();
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
  // 4 rows. Then rank 1 plans a step of 5 where the two hold 4: the step's exchange, which
  // carries the counts, must stop it, naming them (Note [Ranks that split differently]).
  // The loss is 0.25 x the sum of the outputs, averaged over the rows: dy = 0.25 / rows.
  const Tensor x = random_input(4);
  auto reference = three_linears();
  LocalGradients local;
  local.attach(*reference);
  reference->forward(x);
  local.before_backward({4, true});
  reference->backward(Tensor::full({4, 100}, 0.25f / 4.0f));
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
      rank.exchange.issue({}, info, reducer.last_wait_ns());
      // The mean over this rank's rows, scaled as the loop scales it.
      model->backward(Tensor::full({rows, 100}, 0.25f / static_cast<float>(rows) * reducer.loss_gradient_scale()));
      reducer.after_backward();
      rank.exchange.finish();
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
