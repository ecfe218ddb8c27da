// Every layer's backward against central finite differences (input and parameters).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>

#include "core/error.h"
#include "models/activation.h"
#include "models/batchnorm.h"
#include "models/channel_scale.h"
#include "models/conv.h"
#include "models/dropout.h"
#include "models/flatten.h"
#include "models/init.h"
#include "models/layer_norm.h"
#include "models/linear.h"
#include "models/loss.h"
#include "models/pooling.h"
#include "models/residual.h"
#include "models/sequential.h"
#include "tensor/ops.h"
#include "tests/models/grad_check.h"

using namespace mtrain;
using namespace mtrain::models;
using namespace mtrain::models::testing;

namespace {

void require_gradients_match(Module& m, const Tensor& x, std::mt19937_64& rng,
                             const GradCheckOptions& opt = {}) {
  const std::vector<std::string> failures = check_module_gradients(m, x, rng, opt);
  for (const std::string& f : failures) UNSCOPED_INFO(f);
  CHECK(failures.empty());
}

// Non-trivial affine parameters and running statistics, so every term of the batch
// norm formulas shows up in the gradients.
void randomize_batchnorm(BatchNorm2d& bn, std::mt19937_64& rng) {
  bn.weight().value.copy_(uniform_tensor({bn.num_features()}, rng, 0.5f, 1.5f));
  bn.bias().value.copy_(uniform_tensor({bn.num_features()}, rng, -0.5f, 0.5f));
  for (auto& [name, buffer] : bn.buffers()) {
    if (name == "running_mean") buffer->copy_(uniform_tensor({bn.num_features()}, rng, -0.5f, 0.5f));
    if (name == "running_var") buffer->copy_(uniform_tensor({bn.num_features()}, rng, 0.5f, 2.0f));
  }
}

}  // namespace

TEST_CASE("the gradient check rejects wrong gradients", "[grad_check]") {
  std::mt19937_64 rng(1);
  Linear layer(3, 2);
  init_parameters(layer, {.seed = 1});
  const Tensor x = uniform_tensor({4, 3}, rng);
  const AnalyticGradients g = analytic_gradients(layer, x, rng);
  Tensor input = x.clone();
  const std::vector<double> numeric = numeric_gradient(layer, input, g.projection, input, 1e-2f);
  const GradCheckOptions opt;
  CHECK(compare_gradients("input", g.input, numeric, opt).empty());

  std::vector<float> negated = g.input, scaled = g.input, one_off = g.input;
  for (float& v : negated) v = -v;
  for (float& v : scaled) v *= 1.05f;  // a 5 % error, e.g. a wrong normaliser
  one_off[1] += 0.01f;
  CHECK_FALSE(compare_gradients("input", negated, numeric, opt).empty());
  CHECK_FALSE(compare_gradients("input", scaled, numeric, opt).empty());
  CHECK_FALSE(compare_gradients("input", one_off, numeric, opt).empty());
}

TEST_CASE("Conv2d backward matches finite differences", "[layers][conv]") {
  std::mt19937_64 rng(2);
  struct Case { int stride, padding; bool bias; int64_t h, w; };
  for (const Case c : {Case{1, 0, true, 5, 5}, Case{1, 1, false, 4, 5}, Case{2, 1, true, 5, 6},
                       Case{2, 0, false, 6, 5}}) {
    INFO("stride " << c.stride << " padding " << c.padding << " bias " << c.bias);
    Conv2d conv({.in_channels = 2, .out_channels = 3, .kernel_size = 3, .stride = c.stride,
                 .padding = c.padding, .bias = c.bias});
    init_parameters(conv, {.seed = 2});
    CHECK(conv.parameters().size() == (c.bias ? 2u : 1u));
    require_gradients_match(conv, uniform_tensor({2, 2, c.h, c.w}, rng), rng);
  }
}

TEST_CASE("Conv2d with rectangular windows (Inception's 1x7 and 7x1) matches finite differences", "[layers][conv]") {
  std::mt19937_64 rng(5);
  Conv2d wide({.in_channels = 2, .out_channels = 3, .kernel_size = 1, .padding = 0, .kernel_w = 5, .stride_w = 2,
               .padding_w = 2});
  CHECK(wide.weight().value.shape() == Shape{3, 2, 1, 5});
  CHECK(wide.forward(uniform_tensor({1, 2, 4, 7}, rng)).shape() == Shape{1, 3, 4, 4});
  init_parameters(wide, {.seed = 5});
  require_gradients_match(wide, uniform_tensor({2, 2, 4, 7}, rng), rng);
  Conv2d tall({.in_channels = 2, .out_channels = 2, .kernel_size = 3, .stride = 2, .padding = 1, .kernel_w = 1,
               .stride_w = 1, .padding_w = 0});
  CHECK(tall.forward(uniform_tensor({1, 2, 5, 3}, rng)).shape() == Shape{1, 2, 3, 3});
  init_parameters(tall, {.seed = 6});
  require_gradients_match(tall, uniform_tensor({2, 2, 5, 3}, rng), rng);
  CHECK_THROWS_WITH(Conv2d({.in_channels = 1, .out_channels = 1, .kernel_size = 1, .padding_w = -2}),
                    Catch::Contains("padding >= 0"));
}

TEST_CASE("dilated Conv2d matches finite differences", "[layers][conv]") {
  std::mt19937_64 rng(6);
  Conv2d conv({.in_channels = 2, .out_channels = 3, .kernel_size = 3, .padding = 2, .dilation = 2, .dilation_w = 1});
  // A 3x3 window spans 5 rows (taps 2 apart) and 3 columns.
  CHECK(conv.forward(uniform_tensor({1, 2, 6, 5}, rng)).shape() == Shape{1, 3, 6, 7});
  init_parameters(conv, {.seed = 7});
  require_gradients_match(conv, uniform_tensor({2, 2, 6, 5}, rng), rng);
  CHECK_THROWS_WITH(Conv2d({.in_channels = 1, .out_channels = 1, .kernel_size = 1, .dilation = 0}),
                    Catch::Contains("dilation >= 1"));
}

TEST_CASE("Conv2d 1x1 with stride (the shortcut) matches finite differences", "[layers][conv]") {
  std::mt19937_64 rng(3);
  Conv2d conv({.in_channels = 3, .out_channels = 2, .kernel_size = 1, .stride = 2});
  init_parameters(conv, {.seed = 3});
  require_gradients_match(conv, uniform_tensor({2, 3, 5, 5}, rng), rng);
}

TEST_CASE("Linear backward matches finite differences", "[layers][linear]") {
  std::mt19937_64 rng(4);
  for (const bool bias : {true, false}) {
    INFO("bias " << bias);
    Linear layer(5, 3, bias);
    init_parameters(layer, {.seed = 4});
    require_gradients_match(layer, uniform_tensor({4, 5}, rng), rng);
  }
}

TEST_CASE("BatchNorm2d backward matches finite differences in train and eval mode",
          "[layers][batchnorm]") {
  std::mt19937_64 rng(5);
  BatchNorm2d bn(3);
  randomize_batchnorm(bn, rng);
  const Tensor x = uniform_tensor({3, 3, 2, 3}, rng, -2.0f, 2.0f);
  // The normalisation is curved in x (through mean and variance): a smaller step keeps
  // the truncation error of the central difference well under the tolerance.
  const GradCheckOptions opt{.eps = 5e-3f};
  SECTION("train") {
    bn.train();
    require_gradients_match(bn, x, rng, opt);
  }
  SECTION("eval") {
    bn.eval();
    require_gradients_match(bn, x, rng, opt);
  }
}

TEST_CASE("ReLU and Sigmoid backward match finite differences", "[layers][activation]") {
  std::mt19937_64 rng(6);
  ReLU relu;
  require_gradients_match(relu, away_from_zero_tensor({2, 3, 2, 2}, rng), rng);
  Sigmoid sigmoid;
  require_gradients_match(sigmoid, uniform_tensor({2, 3, 2, 2}, rng, -3.0f, 3.0f), rng);
}

namespace {
// Values in [low, high] at least `gap` from every kink, where a central difference would
// average two slopes.
Tensor away_from_kinks(const Shape& shape, std::mt19937_64& rng, float low, float high,
                       const std::vector<float>& kinks, float gap = 0.05f) {
  Tensor t = uniform_tensor(shape, rng, low, high);
  std::uniform_real_distribution<float> draw(low, high);
  for (int64_t i = 0; i < t.numel(); ++i) {
    float& v = t.data<float>()[i];
    while (std::any_of(kinks.begin(), kinks.end(), [&](float k) { return std::abs(v - k) < gap; })) v = draw(rng);
  }
  return t;
}
}  // namespace

TEST_CASE("grouped and depthwise Conv2d backward match finite differences", "[layers][conv]") {
  std::mt19937_64 rng(17);
  SECTION("4 groups, bias, stride 2") {
    Conv2d conv({.in_channels = 8, .out_channels = 12, .kernel_size = 3, .stride = 2, .padding = 1, .groups = 4});
    init_parameters(conv, {});
    CHECK(conv.weight().value.shape() == Shape{12, 2, 3, 3});
    require_gradients_match(conv, uniform_tensor({2, 8, 5, 5}, rng), rng);
  }
  SECTION("depthwise") {
    Conv2d conv({.in_channels = 6, .out_channels = 6, .kernel_size = 3, .padding = 1, .bias = false, .groups = 6});
    init_parameters(conv, {});
    require_gradients_match(conv, uniform_tensor({2, 6, 4, 4}, rng), rng);
  }
  // Each output group sees its own input group only: a change in input group 1 leaves
  // output group 0 as it was.
  Conv2d conv({.in_channels = 4, .out_channels = 4, .kernel_size = 1, .groups = 2});
  init_parameters(conv, {});
  Tensor x = uniform_tensor({1, 4, 2, 2}, rng);
  const Tensor before = conv.forward(x).clone();
  x.data<float>()[3 * 4] += 1.0f;  // channel 3, in group 1
  const Tensor after = conv.forward(x);
  for (int i = 0; i < 8; ++i) CHECK(after.data<float>()[i] == before.data<float>()[i]);
  CHECK(after.data<float>()[12] != before.data<float>()[12]);
  CHECK_THROWS_WITH(Conv2d({.in_channels = 6, .out_channels = 4, .kernel_size = 1, .groups = 4}),
                    Catch::Contains("groups >= 1 dividing both channel counts"));
}

TEST_CASE("Dropout: a mask in training, its gradient the same mask; eval and p = 0 pass through",
          "[layers][dropout]") {
  std::mt19937_64 rng(18);
  Dropout dropout(0.5f, 3);
  const Tensor x = uniform_tensor({4, 8, 4, 4}, rng, 0.5f, 1.0f);  // no zeros of its own
  const Tensor y = dropout.forward(x);
  const Tensor dy = uniform_tensor(x.shape(), rng);
  const Tensor dx = dropout.backward(dy);
  int64_t dropped = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = y.data<float>()[i];
    if (v == 0.0f) {
      ++dropped;
      REQUIRE(dx.data<float>()[i] == 0.0f);
    } else {
      REQUIRE(v == x.data<float>()[i] * 2.0f);
      REQUIRE(dx.data<float>()[i] == dy.data<float>()[i] * 2.0f);
    }
  }
  CHECK(dropped > 180);  // of 512, about half
  CHECK(dropped < 330);
  // The next forward draws another mask.
  const Tensor y2 = dropout.forward(x);
  int64_t same = 0;
  for (int64_t i = 0; i < x.numel(); ++i) same += (y2.data<float>()[i] == 0.0f) == (y.data<float>()[i] == 0.0f);
  CHECK(same < 400);
  dropout.backward(dy);
  dropout.eval();
  CHECK(dropout.forward(x).raw_data() == x.raw_data());
  CHECK(dropout.backward(dy).raw_data() == dy.raw_data());
  Dropout none(0.0f, 3);
  CHECK(none.forward(x).raw_data() == x.raw_data());
  CHECK_THROWS_WITH(Dropout(1.0f, 0), Catch::Contains("expected p in [0, 1)"));
}

TEST_CASE("Erf and Affine (GELU's parts) backward match finite differences", "[layers][activation]") {
  std::mt19937_64 rng(18);
  Erf erf;
  require_gradients_match(erf, uniform_tensor({2, 3, 2, 2}, rng, -2.5f, 2.5f), rng);
  CHECK(erf.forward(Tensor::from_vector<float>({0.5f}, {1})).data<float>()[0] == std::erf(0.5f));
  Affine affine(-0.5f, 2.0f);
  require_gradients_match(affine, uniform_tensor({3, 4}, rng), rng);
  CHECK(affine.forward(Tensor::from_vector<float>({3.0f}, {1})).data<float>()[0] == 0.5f);
  CHECK_THROWS_WITH(Affine(1.0f / 0.0f, 0.0f), Catch::Contains("finite"));
}

TEST_CASE("LayerNorm over the last dimension matches finite differences and torch's values", "[layers][norm]") {
  std::mt19937_64 rng(19);
  LayerNorm norm(5, 1e-6f);
  init_parameters(norm, {});
  // Parameters away from their initial 1 and 0, so their gradients are checked in general.
  for (NamedParameter& p : norm.parameters()) p.param->value.copy_(uniform_tensor(p.param->value.shape(), rng));
  require_gradients_match(norm, uniform_tensor({2, 3, 5}, rng), rng);
  // torch.nn.LayerNorm(4)(torch.tensor([[1., 2., 3., 5.]])): mean 2.75, variance 2.1875.
  LayerNorm plain(4);
  const Tensor y = plain.forward(Tensor::from_vector<float>({1, 2, 3, 5}, {1, 4}));
  CHECK(y.data<float>()[0] == Approx(-1.75 / std::sqrt(2.1875 + 1e-5)).epsilon(1e-6));
  CHECK(y.data<float>()[3] == Approx(2.25 / std::sqrt(2.1875 + 1e-5)).epsilon(1e-6));
  CHECK_THROWS_WITH(plain.forward(Tensor::zeros({2, 5})), Catch::Contains("expected float32 input [..., 4]"));
}

TEST_CASE("ChannelScale trains one scale per channel, shared by the images", "[layers][norm]") {
  std::mt19937_64 rng(20);
  ChannelScale scale("layer_scale", {3, 1, 1});
  CHECK(scale.parameters().at(0).name == "layer_scale");
  scale.parameters().at(0).param->value.copy_(uniform_tensor({3, 1, 1}, rng));
  require_gradients_match(scale, uniform_tensor({2, 3, 2, 2}, rng), rng);
  CHECK_THROWS_WITH(ChannelScale("s", {3, 2}), Catch::Contains("all dimensions but one 1"));
}

TEST_CASE("Linear takes rows of features of any leading shape, as torch's", "[layers][linear]") {
  std::mt19937_64 rng(21);
  Linear layer(4, 3);
  init_parameters(layer, {.seed = 21});
  require_gradients_match(layer, uniform_tensor({2, 3, 2, 4}, rng), rng);
  const Tensor x = uniform_tensor({2, 5, 4}, rng);
  const Tensor y = layer.forward(x);
  CHECK(y.shape() == Shape{2, 5, 3});
  const Tensor rows = layer.forward(x.view({10, 4}));
  CHECK(std::equal(rows.data<float>(), rows.data<float>() + rows.numel(), y.data<float>()));
}

TEST_CASE("Hardtanh (ReLU6), Hardsigmoid and Hardswish backward match finite differences",
          "[layers][activation]") {
  std::mt19937_64 rng(16);
  Hardtanh relu6(0.0f, 6.0f);
  require_gradients_match(relu6, away_from_kinks({2, 3, 2, 2}, rng, -2.0f, 8.0f, {0.0f, 6.0f}), rng);
  Hardsigmoid hardsigmoid;
  require_gradients_match(hardsigmoid, away_from_kinks({2, 3, 2, 2}, rng, -5.0f, 5.0f, {-3.0f, 3.0f}), rng);
  Hardswish hardswish;
  require_gradients_match(hardswish, away_from_kinks({2, 3, 2, 2}, rng, -5.0f, 5.0f, {-3.0f, 3.0f}), rng);
  // Each range covers every piece: the flat ones give no gradient, the others do.
  const Tensor x = Tensor::from_vector<float>({-4.0f, -1.0f, 1.0f, 4.0f, 7.0f}, {5});
  const Tensor y = hardswish.forward(x);
  CHECK(y.data<float>()[0] == 0.0f);
  CHECK(y.data<float>()[3] == 4.0f);
  CHECK(y.data<float>()[1] == Approx(-1.0f * 2.0f / 6.0f));
  CHECK(relu6.forward(x).data<float>()[4] == 6.0f);
  CHECK(hardsigmoid.forward(x).data<float>()[2] == Approx(4.0f / 6.0f));
  CHECK_THROWS_WITH(Hardtanh(1.0f, 1.0f), Catch::Contains("expected min < max"));
}

TEST_CASE("pooling backward matches finite differences", "[layers][pooling]") {
  std::mt19937_64 rng(7);
  SECTION("MaxPool2d 2/2") {
    MaxPool2d pool({.kernel_size = 2});
    require_gradients_match(pool, distinct_values_tensor({2, 2, 4, 6}, rng), rng);
  }
  SECTION("MaxPool2d 3/2 padding 1 (overlapping windows)") {
    MaxPool2d pool({.kernel_size = 3, .stride = 2, .padding = 1});
    require_gradients_match(pool, distinct_values_tensor({2, 2, 5, 5}, rng), rng);
  }
  SECTION("AvgPool2d 2/2") {
    AvgPool2d pool({.kernel_size = 2, .stride = 2});
    require_gradients_match(pool, uniform_tensor({2, 3, 4, 4}, rng), rng);
  }
  SECTION("AvgPool2d 3/2 padding 1 (padding counted)") {
    AvgPool2d pool({.kernel_size = 3, .stride = 2, .padding = 1});
    require_gradients_match(pool, uniform_tensor({1, 2, 5, 5}, rng), rng);
  }
  SECTION("AdaptiveAvgPool2d(1)") {
    AdaptiveAvgPool2d pool(1);
    require_gradients_match(pool, uniform_tensor({2, 3, 3, 4}, rng), rng);
  }
}

TEST_CASE("Flatten is a reshape both ways", "[layers][flatten]") {
  std::mt19937_64 rng(8);
  Flatten flatten;
  const Tensor x = uniform_tensor({2, 3, 2, 2}, rng);
  const Tensor y = flatten.forward(x);
  CHECK(y.shape() == Shape{2, 12});
  CHECK(y.to_vector<float>() == x.to_vector<float>());
  require_gradients_match(flatten, x, rng);
}

namespace {
// Smallest |input| of either ReLU in the block, recomputed from its children
// (slots: conv1, conv2, [conv3], bn1, bn2).
float relu_input_margin(Residual& block, const Tensor& x) {
  const size_t bn1 = block.has_shortcut_conv() ? 3 : 2;
  const Tensor inner = block.child(bn1).forward(block.child(0).forward(x));
  Tensor activated = Tensor::empty(inner.shape());
  mtrain::ops::relu_forward(inner, activated);
  const Tensor main = block.child(bn1 + 1).forward(block.child(1).forward(activated));
  const Tensor shortcut = block.has_shortcut_conv() ? block.child(2).forward(x) : x;
  float margin = INFINITY;
  for (const float v : inner.to_vector<float>()) margin = std::min(margin, std::abs(v));
  const float* m = main.data<float>();
  const float* s = shortcut.data<float>();
  for (int64_t i = 0; i < main.numel(); ++i) margin = std::min(margin, std::abs(m[i] + s[i]));
  return margin;
}

// A central difference that straddles a ReLU kink measures the average of two slopes,
// not the gradient. Draw inputs until every ReLU input is at least 20 steps away from
// zero (a step moves a pre-activation by about eps), so the check compares like with like.
void check_residual(Residual& block, const Shape& input_shape, uint64_t seed) {
  const GradCheckOptions opt{.eps = 1e-3f};
  std::mt19937_64 rng(seed);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const Tensor x = uniform_tensor(input_shape, rng);
    if (relu_input_margin(block, x) < 20 * opt.eps) continue;
    require_gradients_match(block, x, rng, opt);
    return;
  }
  FAIL("no input kept the ReLU inputs away from zero");
}
}  // namespace

TEST_CASE("Residual backward matches finite differences end to end", "[layers][residual]") {
  SECTION("identity shortcut") {
    Residual block(2, 2);
    init_parameters(block, {.seed = 9});
    CHECK(block.parameters().size() == 8u);
    check_residual(block, {2, 2, 3, 3}, 9);
  }
  SECTION("1x1 conv shortcut with stride 2") {
    Residual block(2, 3, /*use_1x1conv=*/true, /*stride=*/2);
    init_parameters(block, {.seed = 10});
    CHECK(block.parameters().size() == 10u);
    check_residual(block, {2, 2, 5, 5}, 10);
  }
  SECTION("eval mode") {
    Residual block(2, 3, true, 1);
    init_parameters(block, {.seed = 11});
    block.eval();
    check_residual(block, {2, 2, 3, 3}, 11);
  }
}

TEST_CASE("Sequential backward matches finite differences end to end", "[layers][sequential]") {
  std::mt19937_64 rng(12);
  auto net = make_sequential(
      std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 1, .out_channels = 2,
                                             .kernel_size = 3, .padding = 1}),
      std::make_unique<BatchNorm2d>(2), std::make_unique<Sigmoid>(),
      std::make_unique<AvgPool2d>(Pool2dOptions{.kernel_size = 2}), std::make_unique<Flatten>(),
      std::make_unique<Linear>(8, 3));
  init_parameters(*net, {.seed = 12});
  require_gradients_match(*net, uniform_tensor({3, 1, 4, 4}, rng), rng, {.eps = 5e-3f});
}

TEST_CASE("layers reject inputs of the wrong shape with InvalidArgument", "[layers][errors]") {
  Conv2d conv({.in_channels = 3, .out_channels = 4, .kernel_size = 3});
  CHECK_THROWS_AS(conv.forward(Tensor::zeros({2, 1, 8, 8})), InvalidArgument);
  CHECK_THROWS_AS(conv.forward(Tensor::zeros({2, 3, 2, 2})), InvalidArgument);  // below kernel
  CHECK_THROWS_AS(conv.forward(Tensor::zeros({3, 8, 8})), InvalidArgument);
  CHECK_THROWS_WITH(conv.forward(Tensor::zeros({2, 1, 8, 8})),
                    Catch::Contains("expected input [N, 3, H, W], found [2, 1, 8, 8]"));
  Linear linear(4, 2);
  CHECK_THROWS_AS(linear.forward(Tensor::zeros({2, 5})), InvalidArgument);
  CHECK_THROWS_AS(linear.backward(Tensor::zeros({2, 2})), InvalidArgument);  // no forward yet
  linear.forward(Tensor::zeros({2, 4}));
  CHECK_THROWS_AS(linear.backward(Tensor::zeros({3, 2})), InvalidArgument);
  CHECK_THROWS_AS(linear.forward(Tensor::zeros({2, 4}, DType::Int64)), InvalidArgument);
  CHECK_THROWS_AS(BatchNorm2d(3).forward(Tensor::zeros({2, 4, 2, 2})), InvalidArgument);
  CHECK_THROWS_AS(AdaptiveAvgPool2d(2), InvalidArgument);
  CHECK_THROWS_AS(MaxPool2d({.kernel_size = 2, .padding = 2}), InvalidArgument);
  CHECK_THROWS_AS(Residual(2, 3), InvalidArgument);  // identity shortcut cannot change width
}

TEST_CASE("CrossEntropyLoss is the batch mean, counts hits and has the right gradient",
          "[layers][loss]") {
  std::mt19937_64 rng(13);
  Tensor logits = uniform_tensor({4, 3}, rng, -2.0f, 2.0f);
  const Tensor labels = Tensor::from_vector<int64_t>({0, 2, 1, 2}, {4});
  CrossEntropyLoss criterion;
  auto mean_loss = [&](const Tensor& z) {
    const float* p = z.data<float>();
    double total = 0.0;
    for (int i = 0; i < 4; ++i) {
      double norm = 0.0;
      for (int k = 0; k < 3; ++k) norm += std::exp(static_cast<double>(p[i * 3 + k]));
      total += std::log(norm) - p[i * 3 + labels.data<int64_t>()[i]];
    }
    return total / 4.0;
  };
  int64_t hits = 0;
  for (int i = 0; i < 4; ++i) {
    const float* row = logits.data<float>() + i * 3;
    const int argmax = static_cast<int>(std::max_element(row, row + 3) - row);
    hits += argmax == labels.data<int64_t>()[i];
  }
  const LossResult r = criterion.forward(logits, labels).read();
  CHECK(r.loss == Approx(mean_loss(logits)).epsilon(1e-5));
  CHECK(r.correct == hits);
  CHECK(r.count == 4);

  const std::vector<float> analytic = criterion.backward().to_vector<float>();
  std::vector<double> numeric;
  for (int64_t i = 0; i < logits.numel(); ++i) {
    float* p = logits.data<float>() + i;
    const float saved = *p;
    const float up = saved + 1e-2f, down = saved - 1e-2f;
    *p = up;
    const double plus = mean_loss(logits);
    *p = down;
    const double minus = mean_loss(logits);
    *p = saved;
    numeric.push_back((plus - minus) / (static_cast<double>(up) - down));
  }
  CHECK(compare_gradients("logits", analytic, numeric, {}) == "");

  // value(): the same figures without a gradient, and backward() still the forward's.
  const LossResult v = criterion.value(logits, labels).read();
  CHECK(v.loss == r.loss);
  CHECK(v.correct == r.correct);
  CHECK(v.count == r.count);
  CHECK_FALSE(criterion.value(uniform_tensor({4, 3}, rng, -2.0f, 2.0f), labels).read().loss == r.loss);
  CHECK(criterion.backward().to_vector<float>() == analytic);
  // A label outside [0, K) is reported when the figures are read, naming its sample.
  CHECK_THROWS_AS(criterion.value(logits, Tensor::from_vector<int64_t>({0, 3, 1, 2}, {4})).read(), InvalidArgument);
  CHECK_THROWS_WITH(criterion.forward(logits, Tensor::from_vector<int64_t>({0, 1, -1, 3}, {4})).read(),
                    Catch::Contains("label -1 of sample 2 is outside [0, 3)"));
  CHECK_THROWS_AS(criterion.forward(logits, Tensor::zeros({3}, DType::Int64)), InvalidArgument);
  CHECK_THROWS_AS(criterion.forward(logits, Tensor::zeros({4})), InvalidArgument);  // float labels
  CHECK_THROWS_AS(CrossEntropyLoss().backward(), InvalidArgument);
}
