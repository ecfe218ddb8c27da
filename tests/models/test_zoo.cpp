// The model zoo: every model builds and classifies 28x28 images; names, shapes and
// counts match the torch models they mirror; initialisation is seeded.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "core/error.h"
#include "models/zoo.h"
#include "tests/models/grad_check.h"

using namespace mtrain;
using namespace mtrain::models;
using namespace mtrain::models::testing;

namespace {

// Parameter counts from the layer formulas (torch's, biases on every conv as in d2l).
int64_t conv_count(int64_t in, int64_t out, int64_t k) { return out * in * k * k + out; }
int64_t bn_count(int64_t c) { return 2 * c; }
int64_t linear_count(int64_t in, int64_t out) { return in * out + out; }
int64_t residual_count(int64_t in, int64_t out, bool projected) {
  return conv_count(in, out, 3) + conv_count(out, out, 3) + (projected ? conv_count(in, out, 1) : 0) +
         2 * bn_count(out);
}
int64_t resnet18_count(int64_t in, int64_t classes) {
  int64_t n = conv_count(in, 64, 3) + bn_count(64);
  n += 2 * residual_count(64, 64, false);
  for (const int64_t width : {128, 256, 512}) {
    n += residual_count(width / 2, width, true) + residual_count(width, width, false);
  }
  return n + linear_count(512, classes);
}

std::map<std::string, Shape> param_shapes(Module& m) {
  std::map<std::string, Shape> out;
  for (const NamedParameter& p : m.parameters()) out[p.name] = p.param->value.shape();
  return out;
}

std::map<std::string, Tensor*> buffer_map(Module& m) {
  std::map<std::string, Tensor*> out;
  for (const NamedBuffer& b : m.buffers()) out[b.name] = b.buffer;
  return out;
}

}  // namespace

TEST_CASE("every model builds and maps 28x28 images to [N, num_classes]", "[zoo]") {
  std::mt19937_64 rng(1);
  CHECK(model_names() == std::vector<std::string>{"resnet18", "lenet", "mlp", "simplecnn", "resnet34", "resnet50"});
  for (const std::string& name : model_names()) {
    for (const auto& [channels, classes] : {std::pair{1, 10}, std::pair{3, 7}}) {
      // One forward of each ResNet is enough: they are by far the most expensive.
      if (name.starts_with("resnet") && channels == 1) continue;
      INFO(name << " in_channels " << channels << " num_classes " << classes);
      auto model = build_model(name, channels, classes);
      CHECK(model->is_training());
      const Tensor y = model->forward(uniform_tensor({2, channels, 28, 28}, rng));
      CHECK(y.shape() == Shape{2, classes});
      for (float v : y.to_vector<float>()) CHECK(std::isfinite(v));
    }
  }
}

TEST_CASE("resnet34 and resnet50 have torchvision's structure and parameter names", "[zoo][resnet50]") {
  // Counts and shapes of torchvision.models.resnet50(num_classes=10).state_dict() (0.14).
  auto resnet50 = build_model("resnet50", 3, 10);
  const auto shapes = param_shapes(*resnet50);
  CHECK(shapes.size() == 161u);  // conv1, bn1 (2), 16 blocks x 9, 4 downsamples x 3, fc 2
  CHECK(shapes.at("conv1.weight") == Shape{64, 3, 7, 7});
  CHECK(shapes.count("conv1.bias") == 0);
  CHECK(shapes.at("layer1.0.conv1.weight") == Shape{64, 64, 1, 1});
  CHECK(shapes.at("layer1.0.conv3.weight") == Shape{256, 64, 1, 1});
  CHECK(shapes.at("layer1.0.downsample.0.weight") == Shape{256, 64, 1, 1});
  CHECK(shapes.at("layer1.0.downsample.1.weight") == Shape{256});
  CHECK(shapes.count("layer1.1.downsample.0.weight") == 0);
  CHECK(shapes.at("layer2.0.conv2.weight") == Shape{128, 128, 3, 3});
  CHECK(shapes.at("layer3.5.bn3.bias") == Shape{1024});
  CHECK(shapes.at("layer4.2.conv3.weight") == Shape{2048, 512, 1, 1});
  CHECK(shapes.at("fc.weight") == Shape{10, 2048});
  CHECK(buffer_map(*resnet50).count("layer4.2.bn3.num_batches_tracked") == 1);
  auto resnet34 = build_model("resnet34", 3, 10);
  const auto shapes34 = param_shapes(*resnet34);
  CHECK(shapes34.size() == 110u);  // conv1, bn1 (2), 16 blocks x 6, 3 downsamples x 3, fc 2
  CHECK(shapes34.at("layer1.0.conv1.weight") == Shape{64, 64, 3, 3});
  CHECK(shapes34.count("layer1.0.downsample.0.weight") == 0);
  CHECK(shapes34.at("layer2.0.downsample.0.weight") == Shape{128, 64, 1, 1});
  CHECK(shapes34.at("fc.weight") == Shape{10, 512});
  std::mt19937_64 rng(2);
  CHECK(resnet34->forward(uniform_tensor({1, 3, 64, 64}, rng)).shape() == Shape{1, 10});
}

TEST_CASE("resnet18 has d2l's structure and torch's parameter names", "[zoo][resnet18]") {
  auto model = build_model("resnet18", 1, 10);
  const auto shapes = param_shapes(*model);
  CHECK(shapes.size() == 76u);  // stem 4, 5 plain blocks x 8, 3 projected blocks x 10, fc 2
  CHECK(shapes.at("0.0.weight") == Shape{64, 1, 3, 3});
  CHECK(shapes.at("0.0.bias") == Shape{64});
  CHECK(shapes.at("0.1.weight") == Shape{64});
  CHECK(shapes.at("0.1.bias") == Shape{64});
  CHECK(shapes.at("1.0.conv1.weight") == Shape{64, 64, 3, 3});
  CHECK(shapes.at("1.0.bn1.weight") == Shape{64});
  CHECK(shapes.at("1.1.bn2.bias") == Shape{64});
  CHECK(shapes.count("1.0.conv3.weight") == 0);  // the first stage keeps the identity shortcut
  CHECK(shapes.at("2.0.conv1.weight") == Shape{128, 64, 3, 3});
  CHECK(shapes.at("2.0.conv3.weight") == Shape{128, 64, 1, 1});
  CHECK(shapes.at("2.0.conv3.bias") == Shape{128});
  CHECK(shapes.count("2.1.conv3.weight") == 0);
  CHECK(shapes.at("3.0.conv3.weight") == Shape{256, 128, 1, 1});
  CHECK(shapes.at("4.0.conv3.weight") == Shape{512, 256, 1, 1});
  CHECK(shapes.at("4.1.conv2.weight") == Shape{512, 512, 3, 3});
  CHECK(shapes.at("7.weight") == Shape{10, 512});
  CHECK(shapes.at("7.bias") == Shape{10});

  const auto buffers = buffer_map(*model);
  CHECK(buffers.size() == 17u * 3u);  // stem BN + 2 per block
  CHECK(buffers.at("0.1.running_mean")->shape() == Shape{64});
  CHECK(buffers.at("0.1.running_var")->shape() == Shape{64});
  CHECK(buffers.at("0.1.num_batches_tracked")->dtype() == DType::Int64);
  CHECK(buffers.at("0.1.num_batches_tracked")->shape() == Shape{});
  CHECK(buffers.at("4.1.bn2.running_var")->shape() == Shape{512});

  CHECK(model->num_parameter_elements() == resnet18_count(1, 10));
  // The 3x3 stem gives 11,175,818; the often-quoted 11,178,378 is d2l's ImageNet-style
  // 7x7 stem (64 * 49 instead of 64 * 9 stem weights: 2,560 more).
  CHECK(resnet18_count(1, 10) == 11'175'818);
  CHECK(build_model("resnet18", 3, 100)->num_parameter_elements() == resnet18_count(3, 100));
}

TEST_CASE("lenet, mlp and simplecnn have d2l's layouts and torch's names", "[zoo]") {
  auto lenet = build_model("lenet", 1, 10);
  const auto l = param_shapes(*lenet);
  CHECK(l.size() == 10u);
  CHECK(l.at("0.weight") == Shape{6, 1, 5, 5});
  CHECK(l.at("0.bias") == Shape{6});
  CHECK(l.at("3.weight") == Shape{16, 6, 5, 5});
  CHECK(l.at("7.weight") == Shape{120, 400});
  CHECK(l.at("9.weight") == Shape{84, 120});
  CHECK(l.at("11.weight") == Shape{10, 84});
  CHECK(l.at("11.bias") == Shape{10});
  CHECK(lenet->num_parameter_elements() == conv_count(1, 6, 5) + conv_count(6, 16, 5) +
                                               linear_count(400, 120) + linear_count(120, 84) +
                                               linear_count(84, 10));
  CHECK(lenet->num_parameter_elements() == 61'706);
  CHECK(lenet->buffers().empty());

  auto mlp = build_model("mlp", 1, 10);
  const auto m = param_shapes(*mlp);
  CHECK(m.size() == 4u);
  CHECK(m.at("1.weight") == Shape{256, 784});
  CHECK(m.at("3.weight") == Shape{10, 256});
  CHECK(mlp->num_parameter_elements() == linear_count(784, 256) + linear_count(256, 10));

  auto cnn = build_model("simplecnn", 3, 10);
  const auto c = param_shapes(*cnn);
  CHECK(c.size() == 6u);
  CHECK(c.at("0.weight") == Shape{64, 3, 3, 3});
  CHECK(c.at("2.weight") == Shape{128, 64, 3, 3});
  CHECK(c.at("6.weight") == Shape{10, 128});
}

TEST_CASE("build_model rejects unknown names and bad sizes", "[zoo]") {
  CHECK_THROWS_AS(build_model("resnet101", 1, 10), InvalidArgument);
  CHECK_THROWS_WITH(build_model("resnet101", 1, 10),
                    Catch::Contains("resnet101") && Catch::Contains("resnet18, lenet, mlp, simplecnn, resnet34, resnet50"));
  CHECK_THROWS_AS(build_model("lenet", 0, 10), InvalidArgument);
  CHECK_THROWS_AS(build_model("lenet", 1, 0), InvalidArgument);
  // lenet's classifier assumes 28x28: another size is a clear error, not garbage.
  auto lenet = build_model("lenet", 1, 10);
  CHECK_THROWS_WITH(lenet->forward(Tensor::zeros({1, 1, 32, 32})),
                    Catch::Contains("expected input [N, 400]"));
  // ... which the trainer finds before building, from the data's size.
  CHECK_THROWS_WITH(check_input_size("mlp", 32, 32),
                    Catch::Contains("model 'mlp' takes 28x28 images, the data has 32x32; pick resnet18 or simplecnn"));
  CHECK_THROWS_AS(check_input_size("lenet", 28, 32), InvalidArgument);
  CHECK_NOTHROW(check_input_size("lenet", 28, 28));
  CHECK_NOTHROW(check_input_size("resnet18", 32, 32));
  CHECK_NOTHROW(check_input_size("simplecnn", 17, 40));
  CHECK(build_model("resnet18", 3, 10)->forward(Tensor::zeros({2, 3, 32, 32})).shape() == Shape{2, 10});
}

TEST_CASE("initialisation is seeded and follows the chosen scheme", "[zoo][init]") {
  auto values = [](Module& m) {
    std::vector<float> all;
    for (const NamedParameter& p : m.parameters()) {
      const auto v = p.param->value.to_vector<float>();
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  auto a = build_model("simplecnn", 1, 10, {.seed = 42});
  auto b = build_model("simplecnn", 1, 10, {.seed = 42});
  auto c = build_model("simplecnn", 1, 10, {.seed = 43});
  CHECK(values(*a) == values(*b));
  CHECK(values(*a) != values(*c));

  SECTION("PyTorch default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases") {
    struct Expect { const char* name; double fan_in; };
    for (const Expect e : {Expect{"2.weight", 64.0 * 9}, Expect{"2.bias", 64.0 * 9},
                           Expect{"6.weight", 128.0}}) {
      INFO(e.name);
      const double bound = 1.0 / std::sqrt(e.fan_in);
      for (const NamedParameter& p : a->parameters()) {
        if (p.name != e.name) continue;
        double lo = 1.0, hi = -1.0, sum = 0.0;
        for (float v : p.param->value.to_vector<float>()) {
          lo = std::min<double>(lo, v);
          hi = std::max<double>(hi, v);
          sum += v;
        }
        CHECK(lo >= -bound);
        CHECK(hi <= bound);
        CHECK(lo < -0.9 * bound);  // fills the range, not a narrower one
        CHECK(hi > 0.9 * bound);
        CHECK(std::abs(sum / p.param->value.numel()) < 0.1 * bound);
      }
    }
  }
  SECTION("normal: N(0, 0.01) weights, zero biases, BatchNorm 1 and 0") {
    auto r = build_model("resnet18", 1, 10, {.scheme = InitScheme::kNormal, .seed = 1});
    for (const NamedParameter& p : r->parameters()) {
      const auto v = p.param->value.to_vector<float>();
      const bool is_bn = p.name.find("bn") != std::string::npos || p.name.rfind("0.1.", 0) == 0;
      INFO(p.name);
      if (is_bn) {
        const float expected = p.name.ends_with("weight") ? 1.0f : 0.0f;
        for (float x : v) REQUIRE(x == expected);
      } else if (p.name.ends_with("bias")) {
        for (float x : v) REQUIRE(x == 0.0f);
      } else if (v.size() > 10000) {
        double sum = 0.0, sq = 0.0;
        for (float x : v) { sum += x; sq += double(x) * x; }
        const double mean = sum / v.size();
        CHECK(std::abs(mean) < 1e-3);
        CHECK(std::sqrt(sq / v.size() - mean * mean) == Approx(0.01).epsilon(0.05));
      }
    }
  }
  SECTION("xavier: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) weights, PyTorch's default biases") {
    auto lenet = build_model("lenet", 1, 10, {.scheme = InitScheme::kXavier, .seed = 3});
    int weights = 0;
    for (const NamedParameter& p : lenet->parameters()) {
      const Tensor& t = p.param->value;
      if (t.shape().size() < 2) continue;  // biases: checked through the default section's rule below
      ++weights;
      // torch.nn.init._calculate_fan_in_and_fan_out: [out, in, k...].
      const double receptive = double(t.numel()) / double(t.shape()[0] * t.shape()[1]);
      const double fan_in = t.shape()[1] * receptive, fan_out = t.shape()[0] * receptive;
      const double bound = std::sqrt(6.0 / (fan_in + fan_out));
      const auto v = t.to_vector<float>();
      const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
      INFO(p.name << " bound " << bound);
      CHECK(*lo >= -bound);
      CHECK(*hi <= bound);
      CHECK(*lo < -0.9 * bound);
      CHECK(*hi > 0.9 * bound);
      // The default bound 1/sqrt(fan_in) differs: the scheme is really in effect.
      CHECK(std::abs(bound - 1.0 / std::sqrt(fan_in)) > 0.01 * bound);
    }
    CHECK(weights == 5);  // LeNet: two convolutions, three linear layers
  }
}
