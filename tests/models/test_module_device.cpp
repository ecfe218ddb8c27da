// Models on a device: Module::to, layers allocating on their input's device, and the
// errors for a model and an input (or labels, or a gradient) on different devices.
//
// These run on the CPU alone by using a second host device, cpu:1: its tensors live in
// host memory, so the CPU kernels run on them, but it is a different Device, so a layer
// that allocated anything on the default device (cpu:0) instead of its input's, or that
// missed a device check, shows here exactly as it would with a GPU. The GPU versions of
// these tests are in test_models_cuda.cpp.
#include <catch2/catch.hpp>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/layers.h"
#include "models/optim.h"
#include "tensor/cuda_devices.h"
#include "tests/models/grad_check.h"

using namespace mtrain;
using namespace mtrain::models;
using namespace mtrain::models::testing;

namespace {

const Device kOtherHost = Device::cpu(1);

// Every layer kind of the zoo in one chain: [N,1,8,8] -> [N,3].
std::unique_ptr<Sequential> every_layer_net(uint64_t seed) {
  auto net = make_sequential(
      std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 1, .out_channels = 4,
                                             .kernel_size = 3, .padding = 1}),
      std::make_unique<BatchNorm2d>(4), std::make_unique<ReLU>(),
      std::make_unique<Residual>(4, 4),
      std::make_unique<Residual>(4, 6, /*use_1x1conv=*/true, /*stride=*/2),
      std::make_unique<MaxPool2d>(Pool2dOptions{.kernel_size = 2}),
      std::make_unique<AvgPool2d>(Pool2dOptions{.kernel_size = 2, .stride = 1, .padding = 1}),
      std::make_unique<AdaptiveAvgPool2d>(1), std::make_unique<Flatten>(),
      std::make_unique<Linear>(6, 5), std::make_unique<Sigmoid>(), std::make_unique<Linear>(5, 3));
  init_parameters(*net, {.seed = seed});
  return net;
}

// Every tensor a model owns: parameter values and gradients, then buffers.
std::vector<Tensor> state_of(Module& m) {
  std::vector<Tensor> out;
  for (const NamedParameter& p : m.parameters()) {
    out.push_back(p.param->value);
    out.push_back(p.param->grad);
  }
  for (const NamedBuffer& b : m.buffers()) out.push_back(*b.buffer);
  return out;
}

void require_same_values(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  REQUIRE(a.dtype() == b.dtype());
  if (a.dtype() == DType::Int64) {
    CHECK(a.to_vector<int64_t>() == b.to_vector<int64_t>());
  } else {
    CHECK(a.to_vector<float>() == b.to_vector<float>());
  }
}

}  // namespace

TEST_CASE("Module::to the device it is on keeps every tensor and parameter", "[device]") {
  auto net = every_layer_net(1);
  const std::vector<Tensor> before = state_of(*net);
  std::vector<Parameter*> params_before;
  for (const NamedParameter& p : net->parameters()) params_before.push_back(p.param);

  net->to(Device::cpu());
  const std::vector<Tensor> after = state_of(*net);
  REQUIRE(after.size() == before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    INFO("tensor " << i);
    CHECK(after[i].shares_storage_with(before[i]));
  }
  size_t i = 0;
  for (const NamedParameter& p : net->parameters()) CHECK(p.param == params_before[i++]);
}

TEST_CASE("Module::to another device copies every tensor and keeps parameters and names",
          "[device]") {
  std::mt19937_64 rng(3);
  auto net = every_layer_net(2);
  // Distinct running statistics and a non-zero count, so a buffer left behind shows.
  net->forward(uniform_tensor({4, 1, 8, 8}, rng));
  const std::vector<Tensor> before = state_of(*net);
  std::vector<std::string> names_before;
  std::vector<Parameter*> params_before;
  for (const NamedParameter& p : net->parameters()) {
    names_before.push_back(p.name);
    params_before.push_back(p.param);
  }

  net->to(kOtherHost);
  const std::vector<Tensor> moved = state_of(*net);
  REQUIRE(moved.size() == before.size());
  for (size_t i = 0; i < moved.size(); ++i) {
    INFO("tensor " << i);
    CHECK(moved[i].device() == kOtherHost);
    CHECK_FALSE(moved[i].shares_storage_with(before[i]));
    require_same_values(moved[i], before[i]);
  }
  size_t i = 0;
  for (const NamedParameter& p : net->parameters()) {
    CHECK(p.name == names_before[i]);
    CHECK(p.param == params_before[i]);
    ++i;
  }
  CHECK(dynamic_cast<BatchNorm2d&>(net->child(1)).num_batches_tracked() == 1);

  // And back.
  net->to(Device::cpu());
  const std::vector<Tensor> back = state_of(*net);
  for (size_t k = 0; k < back.size(); ++k) {
    CHECK(back[k].device() == Device::cpu());
    require_same_values(back[k], before[k]);
  }
}

TEST_CASE("a moved model computes on its device what it computes on the CPU, bit for bit",
          "[device]") {
  std::mt19937_64 rng(4);
  auto here = every_layer_net(5);
  auto there = every_layer_net(5);
  there->to(kOtherHost);
  const SgdOptions sgd{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-3f};
  Sgd here_opt(*here, sgd);
  Sgd there_opt(*there, sgd);
  CrossEntropyLoss here_loss, there_loss;
  const Tensor labels = Tensor::from_vector<int64_t>({0, 2, 1, 2}, {4});

  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    const Tensor x = uniform_tensor({4, 1, 8, 8}, rng);
    here_opt.zero_grad();
    there_opt.zero_grad();
    const Tensor y_here = here->forward(x);
    const Tensor y_there = there->forward(x.to(kOtherHost));
    CHECK(y_there.device() == kOtherHost);
    require_same_values(y_there, y_here);

    const LossResult l_here = here_loss.forward(y_here, labels).read();
    const LossResult l_there = there_loss.forward(y_there, labels.to(kOtherHost)).read();
    CHECK(l_there.loss == l_here.loss);
    const Tensor dlogits = there_loss.backward();
    CHECK(dlogits.device() == kOtherHost);

    const Tensor dx_here = here->backward(here_loss.backward());
    const Tensor dx_there = there->backward(dlogits);
    CHECK(dx_there.device() == kOtherHost);
    require_same_values(dx_there, dx_here);

    here_opt.step();
    there_opt.step();
  }
  const std::vector<Tensor> a = state_of(*here), b = state_of(*there);
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("tensor " << i);
    CHECK(b[i].device() == kOtherHost);
    require_same_values(b[i], a[i]);
  }
  for (const Tensor& buf : there_opt.momentum_buffers()) CHECK(buf.device() == kOtherHost);

  // Eval mode (running statistics) too.
  here->eval();
  there->eval();
  const Tensor x = uniform_tensor({3, 1, 8, 8}, rng);
  const Tensor y_there = there->forward(x.to(kOtherHost));
  CHECK(y_there.device() == kOtherHost);
  require_same_values(y_there, here->forward(x));
  require_same_values(there->backward(Tensor::full({3, 3}, 1.0f).to(kOtherHost)),
                      here->backward(Tensor::full({3, 3}, 1.0f)));
}

TEST_CASE("an input on another device than the model is a clear error", "[device]") {
  auto net = every_layer_net(6);
  net->to(kOtherHost);
  const Tensor x = Tensor::zeros({2, 1, 8, 8});
  CHECK_THROWS_AS(net->forward(x), InvalidArgument);
  CHECK_THROWS_WITH(net->forward(x),
                    Catch::Contains("Conv2d(1, 4, kernel_size=3") &&
                        Catch::Contains("the input is on cpu but the layer's parameters are on "
                                        "cpu:1") &&
                        Catch::Contains("model.to(cpu)"));
  BatchNorm2d bn(3);
  CHECK_THROWS_WITH(bn.forward(Tensor::zeros({2, 3, 2, 2}, DType::Float32, kOtherHost)),
                    Catch::Contains("BatchNorm2d(3, eps=1e-05, momentum=0.1): the input is on "
                                    "cpu:1 but the layer's parameters are on cpu"));
  Linear linear(4, 2);
  CHECK_THROWS_WITH(linear.forward(Tensor::zeros({1, 4}, DType::Float32, kOtherHost)),
                    Catch::Contains("Linear(in_features=4") && Catch::Contains("model.to(cpu:1)"));

  // The gradient must come back on the forward's device.
  const Tensor y = net->forward(x.to(kOtherHost));
  CHECK_THROWS_WITH(net->backward(Tensor::zeros(y.shape())),
                    Catch::Contains("expected the output gradient on cpu:1, where the forward "
                                    "ran, found it on cpu"));
  ReLU relu;
  relu.forward(Tensor::zeros({2}, DType::Float32, kOtherHost));
  CHECK_THROWS_AS(relu.backward(Tensor::zeros({2})), InvalidArgument);
}

TEST_CASE("labels on another device than the logits are a clear error", "[device]") {
  CrossEntropyLoss loss;
  const Tensor logits = Tensor::zeros({2, 3}, DType::Float32, kOtherHost);
  const Tensor labels = Tensor::from_vector<int64_t>({0, 1}, {2});
  CHECK_THROWS_AS(loss.forward(logits, labels), InvalidArgument);
  CHECK_THROWS_WITH(loss.forward(logits, labels),
                    Catch::Contains("the logits are on cpu:1 but the labels are on cpu") &&
                        Catch::Contains(".to(cpu:1)"));
  CHECK_NOTHROW(loss.forward(logits, labels.to(kOtherHost)));
}

TEST_CASE("SGD over a model split across devices names the parameters", "[device]") {
  auto net = every_layer_net(7);
  net->child(0).to(kOtherHost);  // only the first conv
  Sgd opt(*net, {.lr = 0.1f});
  CHECK_THROWS_AS(opt.step(), InvalidArgument);
  CHECK_THROWS_WITH(opt.step(), Catch::Contains("parameter '1.weight' is on cpu but '0.weight' "
                                                "is on cpu:1") &&
                                    Catch::Contains("model.to(device)"));
  CHECK(opt.steps_taken() == 0);
}

TEST_CASE("SGD after the model moved under its momentum buffers is a clear error", "[device]") {
  auto net = every_layer_net(9);
  Sgd opt(*net, {.lr = 0.1f, .momentum = 0.9f});
  opt.step();
  REQUIRE(opt.momentum_buffers()[0].device() == Device::cpu());
  net->to(kOtherHost);
  CHECK_THROWS_WITH(opt.step(), Catch::Contains("the momentum buffer of '0.weight' is on cpu but "
                                                "the parameter is on cpu:1"));
  CHECK(opt.steps_taken() == 1);
}

TEST_CASE("Module::to a GPU that is not there fails clearly and leaves the model whole",
          "[device]") {
  if (cuda_info().device_count > 0) {
    SUCCEED("a GPU is present: the moves are tested in test_models_cuda");
    return;
  }
  auto net = every_layer_net(8);
  const std::vector<Tensor> before = state_of(*net);
  CHECK_THROWS_AS(net->to(Device::cuda(0)), InvalidArgument);
  CHECK_THROWS_WITH(net->to(Device::cuda(0)), Catch::Contains("cuda:0"));
  const std::vector<Tensor> after = state_of(*net);
  for (size_t i = 0; i < after.size(); ++i) CHECK(after[i].shares_storage_with(before[i]));
}
