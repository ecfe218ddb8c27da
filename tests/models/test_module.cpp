// Module plumbing: gradient accumulation, zero_grad, the grad-ready hook, train/eval,
// traversal and replacement.
#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <random>

#include "models/layers.h"
#include "tests/models/grad_check.h"

using namespace mtrain;
using namespace mtrain::models;
using namespace mtrain::models::testing;

namespace {

// conv(0) -> bn(1) -> relu -> pool -> flatten -> linear(5): 6 parameters.
std::unique_ptr<Sequential> small_net() {
  auto net = make_sequential(
      std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 1, .out_channels = 2,
                                             .kernel_size = 3, .padding = 1}),
      std::make_unique<BatchNorm2d>(2), std::make_unique<ReLU>(),
      std::make_unique<MaxPool2d>(Pool2dOptions{.kernel_size = 2}), std::make_unique<Flatten>(),
      std::make_unique<Linear>(8, 3));
  init_parameters(*net, {.seed = 7});
  return net;
}

std::vector<std::string> names_of(Module& m) {
  std::vector<std::string> names;
  for (const NamedParameter& p : m.parameters()) names.push_back(p.name);
  return names;
}

struct HookRecord {
  std::vector<int> order;
  std::map<int, std::vector<float>> grad_at_call;
};

void record_hooks(Module& m, HookRecord& rec) {
  m.set_grad_ready_hook([&rec](Parameter& p) {
    rec.order.push_back(p.index);
    rec.grad_at_call[p.index] = p.grad.to_vector<float>();
  });
}

}  // namespace

TEST_CASE("parameters and buffers are named and ordered as torch's state_dict", "[module]") {
  auto net = small_net();
  CHECK(names_of(*net) ==
        std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "5.weight", "5.bias"});
  std::vector<std::string> buffers;
  for (const NamedBuffer& b : net->buffers()) buffers.push_back(b.name);
  CHECK(buffers ==
        std::vector<std::string>{"1.running_mean", "1.running_var", "1.num_batches_tracked"});

  Residual block(2, 3, true, 2);
  CHECK(names_of(block) == std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight",
                                                    "conv2.bias", "conv3.weight", "conv3.bias",
                                                    "bn1.weight", "bn1.bias", "bn2.weight",
                                                    "bn2.bias"});
  std::vector<std::string> modules;
  for (auto& [path, m] : block.named_modules()) modules.push_back(path + ":" + m->type_name());
  CHECK(modules == std::vector<std::string>{":Residual", "conv1:Conv2d", "conv2:Conv2d",
                                            "conv3:Conv2d", "bn1:BatchNorm2d", "bn2:BatchNorm2d"});
}

TEST_CASE("gradients accumulate across backward calls until zero_grad", "[module]") {
  std::mt19937_64 rng(1);
  auto net = small_net();
  const Tensor x = uniform_tensor({2, 1, 4, 4}, rng);
  const Tensor dy = uniform_tensor({2, 3}, rng);

  net->zero_grad();
  net->forward(x);
  const Tensor dx_once = net->backward(dy);
  std::vector<std::vector<float>> once;
  for (const NamedParameter& p : net->parameters()) once.push_back(p.param->grad.to_vector<float>());

  net->forward(x);
  const Tensor dx_twice = net->backward(dy);
  size_t i = 0;
  for (const NamedParameter& p : net->parameters()) {
    INFO(p.name);
    const std::vector<float> twice = p.param->grad.to_vector<float>();
    bool nonzero = false;
    for (size_t k = 0; k < twice.size(); ++k) {
      CHECK(twice[k] == Approx(2.0f * once[i][k]).margin(1e-6));
      nonzero = nonzero || once[i][k] != 0.0f;
    }
    CHECK(nonzero);
    ++i;
  }
  // Input gradients are not accumulated: each backward returns its own.
  CHECK(dx_twice.to_vector<float>() == dx_once.to_vector<float>());

  net->zero_grad();
  for (const NamedParameter& p : net->parameters()) {
    for (float g : p.param->grad.to_vector<float>()) CHECK(g == 0.0f);
  }
}

TEST_CASE("without an input gradient the first layer skips it and the parameter gradients stay the same",
          "[module]") {
  std::mt19937_64 rng(2);
  const Tensor x = uniform_tensor({2, 1, 4, 4}, rng);
  const Tensor dy = uniform_tensor({2, 3}, rng);
  auto grads_of = [&](bool input_grad) {
    auto net = small_net();
    net->set_input_grad_needed(input_grad);
    net->zero_grad();
    net->forward(x);
    const Tensor dx = net->backward(dy);
    CHECK(dx.defined() == input_grad);
    std::vector<std::vector<float>> grads;
    for (const NamedParameter& p : net->parameters()) grads.push_back(p.param->grad.to_vector<float>());
    return grads;
  };
  CHECK(grads_of(false) == grads_of(true));

  // Only the layer that sees the input skips: a second Linear still returns its dx.
  Linear first(3, 4), second(4, 2);
  first.set_input_grad_needed(false);
  const Tensor in = uniform_tensor({5, 3}, rng);
  second.forward(first.forward(in));
  const Tensor d_mid = second.backward(uniform_tensor({5, 2}, rng));
  CHECK(d_mid.defined());
  CHECK_FALSE(first.backward(d_mid).defined());
}

TEST_CASE("a leading Flatten passes the setting on: mlp's first Linear skips its input gradient too", "[module]") {
  // Module::passes_input_grad_setting. Same parameter gradients either way; without the
  // input gradient neither Flatten nor the Linear after it returns one.
  std::mt19937_64 rng(5);
  const Tensor x = uniform_tensor({3, 1, 2, 2}, rng);
  const Tensor dy = uniform_tensor({3, 2}, rng);
  auto run = [&](bool input_grad) {
    Sequential net;
    net.append(std::make_unique<Flatten>()).append(std::make_unique<Linear>(4, 5));
    net.append(std::make_unique<ReLU>()).append(std::make_unique<Linear>(5, 2));
    std::mt19937_64 init(9);
    for (const NamedParameter& p : net.parameters()) p.param->value.copy_(uniform_tensor(p.param->value.shape(), init));
    net.set_input_grad_needed(input_grad);
    CHECK(net.child(1).input_grad_needed() == input_grad);  // the Linear after Flatten
    CHECK(net.child(3).input_grad_needed());                // later layers always
    net.zero_grad();
    net.forward(x);
    CHECK(net.backward(dy).defined() == input_grad);
    std::vector<std::vector<float>> grads;
    for (const NamedParameter& p : net.parameters()) grads.push_back(p.param->grad.to_vector<float>());
    return grads;
  };
  CHECK(run(false) == run(true));
}

TEST_CASE("parameter-free layers refuse a second backward after one forward", "[module]") {
  // Note [Saved tensors die with backward].
  std::mt19937_64 rng(6);
  const Tensor x = uniform_tensor({2, 3, 4, 4}, rng);
  Flatten flatten;
  const Tensor y = flatten.forward(x);
  flatten.backward(y);
  CHECK_THROWS_WITH(flatten.backward(y), Catch::Contains("backward called before forward (or twice"));
  AdaptiveAvgPool2d pool(1);
  const Tensor p = pool.forward(x);
  pool.backward(p);
  CHECK_THROWS_WITH(pool.backward(p), Catch::Contains("backward called before forward (or twice"));
}

TEST_CASE("grad-ready hooks fire once per parameter, in reverse order, with final values",
          "[module][hooks]") {
  std::mt19937_64 rng(2);
  auto net = small_net();
  HookRecord rec;
  record_hooks(*net, rec);
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) CHECK(params[i].param->index == static_cast<int>(i));

  const Tensor x = uniform_tensor({2, 1, 4, 4}, rng);
  for (int pass = 0; pass < 2; ++pass) {
    INFO("backward pass " << pass);
    rec = {};
    net->forward(x);
    net->backward(uniform_tensor({2, 3}, rng));
    // A Sequential chain finishes its gradients in reverse registration order.
    CHECK(rec.order == std::vector<int>{5, 4, 3, 2, 1, 0});
    // The value seen by the hook is the final (accumulated) one: nothing writes later.
    for (const NamedParameter& p : params) {
      CHECK(rec.grad_at_call.at(p.param->index) == p.param->grad.to_vector<float>());
    }
  }

  net->set_grad_ready_hook(nullptr);
  rec = {};
  net->forward(x);
  net->backward(uniform_tensor({2, 3}, rng));
  CHECK(rec.order.empty());
}

TEST_CASE("inside a Residual block hooks follow reverse forward order", "[module][hooks]") {
  std::mt19937_64 rng(3);
  Residual block(2, 3, true, 2);
  init_parameters(block, {.seed = 3});
  HookRecord rec;
  record_hooks(block, rec);
  block.forward(uniform_tensor({2, 2, 4, 4}, rng));
  block.backward(uniform_tensor({2, 3, 2, 2}, rng));
  // Registration: conv1 w,b (0,1) conv2 (2,3) conv3 (4,5) bn1 (6,7) bn2 (8,9). Forward
  // runs conv1, bn1, conv2, bn2, conv3; backward finishes them in the reverse.
  CHECK(rec.order == std::vector<int>{5, 4, 9, 8, 3, 2, 7, 6, 1, 0});
  for (const NamedParameter& p : block.parameters()) {
    CHECK(rec.grad_at_call.at(p.param->index) == p.param->grad.to_vector<float>());
  }
}

TEST_CASE("train and eval reach every module, including replaced ones", "[module]") {
  auto net = small_net();
  CHECK(net->is_training());
  net->eval();
  for (auto& [path, m] : net->named_modules()) CHECK_FALSE(m->is_training());
  net->train();
  for (auto& [path, m] : net->named_modules()) CHECK(m->is_training());
  net->eval();
  auto old = net->replace_child(2, std::make_unique<Sigmoid>());
  CHECK(old->type_name() == "ReLU");
  CHECK(net->child(2).type_name() == "Sigmoid");
  CHECK_FALSE(net->child(2).is_training());  // takes the parent's mode
}

namespace {
class TaggedBatchNorm : public BatchNorm2d {
 public:
  explicit TaggedBatchNorm(const BatchNorm2d& source)
      : BatchNorm2d(source.num_features(), source.eps(), source.momentum()) {
    copy_state_from(source);
  }
  std::string type_name() const override { return "TaggedBatchNorm"; }
};
}  // namespace

TEST_CASE("replace_modules swaps every BatchNorm2d and keeps names and values", "[module]") {
  auto net = make_sequential(small_net(), std::make_unique<Residual>(2, 2));
  init_parameters(*net, {.seed = 5});
  // Distinguishable state to see that it is carried over.
  auto& bn = dynamic_cast<BatchNorm2d&>(net->child(0).child(1));
  bn.weight().value.fill_(0.5f);
  const std::vector<std::string> names_before = names_of(*net);

  const int replaced = replace_modules(*net, [](Module& m) -> std::unique_ptr<Module> {
    if (auto* b = dynamic_cast<BatchNorm2d*>(&m)) return std::make_unique<TaggedBatchNorm>(*b);
    return nullptr;
  });
  CHECK(replaced == 3);
  CHECK(names_of(*net) == names_before);
  int tagged = 0;
  for (auto& [path, m] : net->named_modules()) {
    if (m->type_name() == "TaggedBatchNorm") ++tagged;
    CHECK(m->type_name() != "BatchNorm2d");
  }
  CHECK(tagged == 3);
  auto& swapped = dynamic_cast<BatchNorm2d&>(net->child(0).child(1));
  CHECK(swapped.weight().value.to_vector<float>() == std::vector<float>{0.5f, 0.5f});
  // The Residual block reaches its children by slot, so it runs the replacements.
  std::mt19937_64 rng(5);
  const Tensor y = net->child(1).forward(uniform_tensor({2, 2, 3, 3}, rng));
  CHECK(dynamic_cast<BatchNorm2d&>(net->child(1).child(2)).num_batches_tracked() == 1);
  CHECK(y.shape() == Shape{2, 2, 3, 3});
}
