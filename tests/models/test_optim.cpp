// SGD against hand-computed torch.optim.SGD steps, and a few real training steps.
#include <catch2/catch.hpp>

#include <random>

#include "core/error.h"
#include "models/linear.h"
#include "models/loss.h"
#include "models/optim.h"
#include "models/zoo.h"
#include "tensor/ops.h"
#include "tests/models/grad_check.h"

using namespace mtrain;
using namespace mtrain::models;
using namespace mtrain::models::testing;

TEST_CASE("SGD follows torch.optim.SGD step by step", "[optim]") {
  // One weight starting at 1.0 sees the gradients 0.5, -0.25, 1.0. Expected values are
  // torch's update worked by hand, e.g. momentum 0.9, dampening 0.1, weight decay 0.01:
  //   step 1: d = 0.5 + 0.01*1 = 0.51, buf = d (no dampening on the first step),
  //           p = 1 - 0.1*0.51 = 0.949
  //   step 2: d = -0.25 + 0.00949 = -0.24051, buf = 0.9*0.51 + 0.9*d = 0.242541,
  //           p = 0.949 - 0.0242541 = 0.9247459
  //   step 3: d = 1.009247459, buf = 0.9*0.242541 + 0.9*d = 1.1266096131, p = 0.81208493869
  struct Scenario {
    const char* what;
    SgdOptions options;
    double expected[3];
  };
  const Scenario scenarios[] = {
      {"plain", {.lr = 0.1f}, {0.95, 0.975, 0.875}},
      {"weight decay", {.lr = 0.1f, .weight_decay = 0.01f}, {0.949, 0.973051, 0.872077949}},
      {"momentum + dampening + weight decay",
       {.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 0.01f},
       {0.949, 0.9247459, 0.81208493869}},
      {"nesterov + weight decay",
       {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true},
       {0.9031, 0.90757411, 0.6981892081909999}},
  };
  const float grads[] = {0.5f, -0.25f, 1.0f};
  for (const Scenario& s : scenarios) {
    INFO(s.what);
    Linear layer(1, 1, /*bias=*/false);
    layer.weight().value.fill_(1.0f);
    Sgd sgd(layer, s.options);
    REQUIRE(sgd.momentum_buffers().size() == 1u);
    CHECK_FALSE(sgd.momentum_buffers()[0].defined());
    for (int t = 0; t < 3; ++t) {
      sgd.zero_grad();
      layer.weight().grad.fill_(grads[t]);
      sgd.step();
      CHECK(layer.weight().value.data<float>()[0] == Approx(s.expected[t]).epsilon(1e-5));
    }
    CHECK(sgd.steps_taken() == 3);
    CHECK(sgd.momentum_buffers()[0].defined() == (s.options.momentum != 0.0f));
  }
}

TEST_CASE("SGD rejects the option combinations torch rejects", "[optim]") {
  Linear layer(2, 2);
  CHECK_THROWS_AS(Sgd(layer, {.lr = -0.1f}), InvalidArgument);
  CHECK_THROWS_AS(Sgd(layer, {.lr = 0.1f, .momentum = -0.5f}), InvalidArgument);
  CHECK_THROWS_AS(Sgd(layer, {.lr = 0.1f, .weight_decay = -1.0f}), InvalidArgument);
  CHECK_THROWS_AS(Sgd(layer, {.lr = 0.1f, .nesterov = true}), InvalidArgument);
  CHECK_THROWS_AS(Sgd(layer, {.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f, .nesterov = true}),
                  InvalidArgument);
  Sgd sgd(layer, {.lr = 0.1f});
  CHECK_THROWS_AS(sgd.set_lr(-1.0f), InvalidArgument);
  sgd.set_lr(0.01f);
  CHECK(sgd.lr() == 0.01f);
}

TEST_CASE("resnet18 learns a tiny batch in five SGD steps", "[optim][resnet18]") {
  ops::set_num_threads(2);
  std::mt19937_64 rng(7);
  auto model = build_model("resnet18", 1, 10, {.seed = 7});
  const Tensor images = uniform_tensor({8, 1, 28, 28}, rng);
  std::vector<int64_t> label_values;
  for (int i = 0; i < 8; ++i) label_values.push_back(i % 10);
  const Tensor labels = Tensor::from_vector<int64_t>(label_values, {8});

  CrossEntropyLoss criterion;
  Sgd sgd(*model, {.lr = 0.05f, .momentum = 0.9f});
  std::vector<double> losses;
  for (int step = 0; step < 5; ++step) {
    sgd.zero_grad();
    const LossResult r = criterion.forward(model->forward(images), labels).read();
    REQUIRE(std::isfinite(r.loss));
    CHECK(r.count == 8);
    losses.push_back(r.loss);
    model->backward(criterion.backward());
    sgd.step();
  }
  const LossResult after = criterion.forward(model->forward(images), labels).read();
  INFO("losses " << losses[0] << " " << losses[1] << " " << losses[2] << " " << losses[3] << " "
                 << losses[4] << " -> " << after.loss);
  // Ten classes at random init: about ln 10 = 2.30.
  CHECK(losses[0] == Approx(std::log(10.0)).margin(0.5));
  CHECK(after.loss < 0.5 * losses[0]);
  CHECK(after.correct > 2);
}
