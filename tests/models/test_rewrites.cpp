// The model rewrites of models/rewrites.h against the model as built: fuse_batchnorm changes
// no bit of resnet18's outputs, gradients or buffers (also under SyncBatchNorm and in eval
// mode); skip_conv_bias changes them by float rounding only and leaves the skipped biases'
// gradients exactly zero; use_channels_last keeps the function, to float rounding; and the
// fresh-gradient mark (Parameter::grad_fresh) makes a layer's first write overwrite and its
// next one add; set_activation_dtype (models/mixed_precision.h) keeps the function to 16-bit
// rounding.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>

#include "core/error.h"
#include "models/layers.h"
#include "models/mixed_precision.h"
#include "models/sync_batchnorm.h"
#include "models/zoo.h"
#include "tensor/ops.h"
#include "tests/models/grad_check.h"
#include "tests/support/solo_group.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using namespace mtrain::models;
using mtrain::models::testing::uniform_tensor;

namespace {

std::unique_ptr<Module> resnet18() {
  InitOptions init;
  init.seed = 3;
  return build_model("resnet18", 1, 10, init);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}


double max_abs(const Tensor& a) {
  double worst = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(a.data<float>()[i])));
  return worst;
}

// One step of `model` on (x, dy): zeroed gradients, forward, backward, then SGD at `lr` so
// that the next step sees new weights. Returns the output and the input gradient.
std::pair<Tensor, Tensor> step(Module& model, const Tensor& x, const Tensor& dy, float lr = 0.05f) {
  model.zero_grad();
  Tensor y = model.forward(x);
  Tensor dx = model.backward(dy);
  for (const NamedParameter& p : model.parameters()) ops::add_(p.param->value, p.param->grad, -lr);
  return {y, dx};
}

// Calls check(name, a's tensor, b's tensor) for every parameter gradient and buffer.
template <class Check>
void for_each_state(Module& a, Module& b, const Check& check) {
  const auto pa = a.parameters(), pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    REQUIRE(pa[i].name == pb[i].name);
    check(pa[i].name + " (gradient)", pa[i].param->grad, pb[i].param->grad);
    check(pa[i].name, pa[i].param->value, pb[i].param->value);
  }
  const auto ba = a.buffers(), bb = b.buffers();
  REQUIRE(ba.size() == bb.size());
  for (size_t i = 0; i < ba.size(); ++i) {
    REQUIRE(ba[i].name == bb[i].name);
    check(ba[i].name, *ba[i].buffer, *bb[i].buffer);
  }
}

void require_same_bits(Module& a, Module& b) {
  for_each_state(a, b, [](const std::string& name, const Tensor& x, const Tensor& y) {
    INFO(name);
    CHECK(same_bits(x, y));
  });
}

}  // namespace

TEST_CASE("fuse_batchnorm leaves resnet18's outputs, gradients and buffers bitwise as they were",
          "[fusion]") {
  std::mt19937_64 rng(7);
  const Tensor x = uniform_tensor({6, 1, 12, 12}, rng);
  const Tensor dy = uniform_tensor({6, 10}, rng);
  auto plain = resnet18();
  auto fused = resnet18();
  const bool sync = GENERATE(false, true);
  CAPTURE(sync);
  mtrain::testing::SoloGroup solo;
  // The conversion carries the fusion over, whichever comes first.
  if (sync) convert_sync_batchnorm(*plain, solo.group);
  // The stem's batch norm and ReLU, and two of each per block (bn1's ReLU, bn2's add and ReLU).
  CHECK(fuse_batchnorm(*fused) == 1 + 8 * 2);
  if (sync) convert_sync_batchnorm(*fused, solo.group);
  CHECK(fused->child(0).child(2).type_name() == "Identity");
  auto* bn = dynamic_cast<BatchNorm2d*>(&fused->child(0).child(1));
  REQUIRE(bn != nullptr);
  CHECK(bn->fused_relu());
  CHECK(bn->type_name() == (sync ? "SyncBatchNorm" : "BatchNorm2d"));

  for (int i = 0; i < 2; ++i) {
    const auto [y_plain, dx_plain] = step(*plain, x, dy);
    const auto [y_fused, dx_fused] = step(*fused, x, dy);
    CHECK(same_bits(y_fused, y_plain));
    CHECK(same_bits(dx_fused, dx_plain));
    require_same_bits(*plain, *fused);
  }
  plain->eval();
  fused->eval();
  CHECK(same_bits(fused->forward(x), plain->forward(x)));
  // Backward in eval mode (the statistics are constants) is the same too.
  CHECK(same_bits(fused->backward(dy), plain->backward(dy)));
}

TEST_CASE("a fused batch norm's backward must match its forward", "[fusion]") {
  std::mt19937_64 rng(8);
  BatchNorm2d bn(3);
  const Tensor x = uniform_tensor({2, 3, 4, 4}, rng);
  const Tensor dy = uniform_tensor({2, 3, 4, 4}, rng);
  bn.forward_add_relu(x, uniform_tensor({2, 3, 4, 4}, rng));
  CHECK_THROWS_AS(bn.backward(dy), InternalError);
  bn.forward(x);
  Tensor dres;
  CHECK_THROWS_AS(bn.backward_add_relu(dy, dres), InternalError);
  CHECK_THROWS_WITH(bn.forward_add_relu(x, uniform_tensor({2, 3, 4, 3}, rng)),
                    Catch::Contains("residual"));
}

// Note [Conv bias before a batch norm]: where a bias is 0 nothing changes at all; where it
// is not, a convolution and its batch norm give the outputs, running statistics and eval
// outputs of the unskipped pair to float rounding, and the bias gradient is exactly 0.
TEST_CASE("skip_conv_bias: a conv and its batch norm compute what they computed", "[fusion]") {
  std::mt19937_64 rng(9);
  const auto pair = [] {
    auto seq = make_sequential(
        std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 2, .out_channels = 4, .kernel_size = 3, .padding = 1}),
        std::make_unique<BatchNorm2d>(4));
    InitOptions init;
    init.seed = 11;
    init_parameters(*seq, init);
    // Biases far from zero next to the spread, which rounding notices most.
    dynamic_cast<Conv2d&>(seq->child(0)).bias().value.fill_(3.0f);
    return seq;
  };
  auto plain = pair();
  auto skipped = pair();
  CHECK(skip_conv_bias(*skipped) == 1);
  const Tensor x = uniform_tensor({5, 2, 6, 6}, rng);
  const Tensor dy = uniform_tensor({5, 4, 6, 6}, rng);
  for (int i = 0; i < 3; ++i) {
    const auto [y_plain, dx_plain] = step(*plain, x, dy);
    const auto [y_skipped, dx_skipped] = step(*skipped, x, dy);
    CHECK(mtrain::testing::max_abs_gap(y_skipped, y_plain) <= 1e-5 * max_abs(y_plain));
    CHECK(mtrain::testing::max_abs_gap(dx_skipped, dx_plain) <= 1e-5 * max_abs(dx_plain));
    for_each_state(*plain, *skipped, [&](const std::string& name, const Tensor& a, const Tensor& b) {
      INFO(name);
      if (a.dtype() != DType::Float32) {
        CHECK(same_bits(a, b));  // the batch counter
      } else if (name == "0.bias (gradient)") {
        CHECK(max_abs(b) == 0.0);            // exactly: nothing wrote it
        CHECK(max_abs(a) < 1e-5);            // the unskipped one: rounding noise around zero
      } else if (name == "0.bias") {
        CHECK(mtrain::testing::max_abs_gap(a, b) < 1e-6);    // moved by that noise only
      } else {
        CHECK(mtrain::testing::max_abs_gap(a, b) <= 1e-5 * std::max(max_abs(a), 1.0));
      }
    });
  }
  // The running mean holds the bias (about 3), and eval mode subtracts it again.
  CHECK(max_abs(dynamic_cast<BatchNorm2d&>(skipped->child(1)).running_mean()) > 0.5);
  plain->eval();
  skipped->eval();
  const Tensor y_plain = plain->forward(x);
  CHECK(mtrain::testing::max_abs_gap(skipped->forward(x), y_plain) <= 1e-5 * max_abs(y_plain));
  // An eval-mode backward sums the bias gradient: the batch norm's mean is a constant then.
  plain->zero_grad();
  skipped->zero_grad();
  plain->backward(dy);
  skipped->backward(dy);
  const Tensor& db_plain = plain->parameters()[1].param->grad;
  CHECK(max_abs(db_plain) > 1e-2);
  CHECK(mtrain::testing::max_abs_gap(skipped->parameters()[1].param->grad, db_plain) <= 1e-5 * max_abs(db_plain));
}

TEST_CASE("skip_conv_bias leaves resnet18's bits alone where the biases are zero", "[fusion]") {
  std::mt19937_64 rng(12);
  const Tensor x = uniform_tensor({4, 1, 12, 12}, rng);
  const Tensor dy = uniform_tensor({4, 10}, rng);
  auto plain = resnet18();
  auto skipped = resnet18();
  // The stem's and conv1 and conv2 of every block; not the blocks' 1x1 shortcuts.
  CHECK(skip_conv_bias(*skipped) == 1 + 8 * 2);
  const auto is_skipped = [](const std::string& name) {
    return name.ends_with("conv1.bias") || name.ends_with("conv2.bias") || name == "0.0.bias";
  };
  for (Module* m : {plain.get(), skipped.get()}) {
    for (const NamedParameter& p : m->parameters()) {
      if (is_skipped(p.name)) p.param->value.zero_();
    }
  }
  // A bias of 0 added to every element changes no bit, and neither does 0 added to the
  // running mean, so the skipped model must give the same bits; with other biases the
  // two differ by rounding, which resnet18 amplifies (Note [Equivalence tolerance] in
  // tests/trainer/ddp/test_distributed_train.cpp: an input moved by one ulp moved the first
  // step's gradients by 2e-3), and the pair test above covers the arithmetic.
  const auto [y_plain, dx_plain] = step(*plain, x, dy);
  const auto [y_skipped, dx_skipped] = step(*skipped, x, dy);
  CHECK(same_bits(y_skipped, y_plain));
  for_each_state(*plain, *skipped, [&](const std::string& name, const Tensor& a, const Tensor& b) {
    INFO(name);
    // A skipped bias: its gradient is 0 instead of rounding noise, so it stays at 0.
    const std::string param = name.substr(0, name.find(' '));
    if (is_skipped(param)) {
      CHECK(max_abs(b) == 0.0);
    } else {
      CHECK(same_bits(a, b));
    }
  });
}

TEST_CASE("a fresh gradient is overwritten by its first writer and added to by the next",
          "[fusion]") {
  std::mt19937_64 rng(10);
  Conv2d conv(Conv2dOptions{.in_channels = 2, .out_channels = 3, .kernel_size = 3, .padding = 1});
  Linear linear(5, 4);
  struct Case {
    Module& layer;
    Tensor x, dy;
  };
  for (Case c : {Case{conv, uniform_tensor({2, 2, 5, 5}, rng), uniform_tensor({2, 3, 5, 5}, rng)},
                 Case{linear, uniform_tensor({3, 5}, rng), uniform_tensor({3, 4}, rng)}}) {
    INFO(c.layer.type_name());
    c.layer.zero_grad();
    c.layer.forward(c.x);
    c.layer.backward(c.dy);
    std::vector<Tensor> once;
    for (const NamedParameter& p : c.layer.parameters()) once.push_back(p.param->grad.clone());
    // Garbage that a fresh write must not add to.
    for (const NamedParameter& p : c.layer.parameters()) p.param->grad.fill_(123.0f);
    mark_gradients_fresh(c.layer);
    c.layer.forward(c.x);
    c.layer.backward(c.dy);
    auto params = c.layer.parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(same_bits(params[i].param->grad, once[i]));
      CHECK_FALSE(params[i].param->grad_fresh);
    }
    // The next backward adds (a second micro-batch): twice the gradient, up to the
    // rounding of a product accumulated into its output block by block (sgemm's beta 1).
    c.layer.forward(c.x);
    c.layer.backward(c.dy);
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor twice = once[i].clone();
      ops::add_(twice, once[i], 1.0f);
      CHECK(mtrain::testing::max_abs_gap(params[i].param->grad, twice) <= 1e-6 * max_abs(twice));
    }
  }
}

namespace {

// Relative distance of two float tensors: ||a - b|| / ||b||.
double relative_gap(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  double apart = 0.0, size = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data<float>()[i], y = b.data<float>()[i];
    apart += (x - y) * (x - y);
    size += y * y;
  }
  return std::sqrt(apart / std::max(size, 1e-30));
}

}  // namespace

// Note [Channels-last models]: the same model, its activations [N, H, W, C]: outputs to
// float rounding (batch norm sums in another order), gradients to the rounding that
// resnet18's ReLUs amplify (test above: one ulp on the input moved them by 2e-3).
TEST_CASE("use_channels_last keeps resnet18's function, with every rewrite and SyncBatchNorm",
          "[channels_last]") {
  std::mt19937_64 rng(13);
  const Tensor x = uniform_tensor({4, 1, 12, 12}, rng);
  const Tensor dy = uniform_tensor({4, 10}, rng);
  const bool others = GENERATE(false, true);
  CAPTURE(others);
  auto plain = resnet18();
  auto last = resnet18();
  mtrain::testing::SoloGroup solo;
  if (others) {
    fuse_batchnorm(*last);
    convert_sync_batchnorm(*last, solo.group);
  }
  // 20 convolutions (3 of them shortcuts), 17 batch norms, the pool and the flatten.
  CHECK(use_channels_last(*last) == 20 + 17 + 2);
  CHECK(dynamic_cast<Conv2d&>(last->child(0).child(0)).channels_last());
  for (int i = 0; i < 2; ++i) {
    const auto [y_plain, dx_plain] = step(*plain, x, dy, 1e-4f);
    const auto [y_last, dx_last] = step(*last, x, dy, 1e-4f);
    CHECK(y_last.shape() == y_plain.shape());
    CHECK(dx_last.shape() == dx_plain.shape());  // the images' gradient comes back NCHW
    CHECK(relative_gap(y_last, y_plain) < 1e-5);
    CHECK(relative_gap(dx_last, dx_plain) < 1e-2);
    for_each_state(*plain, *last, [](const std::string& name, const Tensor& a, const Tensor& b) {
      INFO(name);
      if (a.dtype() != DType::Float32) {
        CHECK(same_bits(a, b));
      } else {
        CHECK(relative_gap(b, a) < 2e-2);
      }
    });
  }
  plain->eval();
  last->eval();
  CHECK(relative_gap(last->forward(x), plain->forward(x)) < 1e-4);
}

TEST_CASE("use_channels_last refuses layers without channels-last kernels and needs a convolution first",
          "[channels_last]") {
  auto lenet = build_model("lenet", 1, 10);
  CHECK_THROWS_WITH(use_channels_last(*lenet), Catch::Contains("AvgPool2d") && Catch::Contains("channels last"));
  // Nothing changed: the model still takes NCHW images through NCHW kernels.
  CHECK_FALSE(dynamic_cast<Conv2d&>(lenet->child(0)).channels_last());
  auto mlp = build_model("mlp", 1, 10);
  CHECK(use_channels_last(*mlp) == 0);  // no convolution: no layout to choose
  auto odd = make_sequential(std::make_unique<ReLU>(),
                             std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 1, .out_channels = 2}));
  CHECK_THROWS_WITH(use_channels_last(*odd), Catch::Contains("ReLU first"));
}

TEST_CASE("a channels-last Flatten gives PyTorch's (c, h, w) order", "[channels_last]") {
  std::mt19937_64 rng(14);
  // A conv, then Flatten over 3x3 planes: the layout must change back before flattening.
  auto plain = make_sequential(
      std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 2, .out_channels = 3, .kernel_size = 3, .stride = 2}),
      std::make_unique<Flatten>(), std::make_unique<Linear>(27, 4));
  auto last = make_sequential(
      std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 2, .out_channels = 3, .kernel_size = 3, .stride = 2}),
      std::make_unique<Flatten>(), std::make_unique<Linear>(27, 4));
  InitOptions init;
  init.seed = 15;
  init_parameters(*plain, init);
  init_parameters(*last, init);
  CHECK(use_channels_last(*last) == 2);
  const Tensor x = uniform_tensor({2, 2, 7, 7}, rng);
  const Tensor dy = uniform_tensor({2, 4}, rng);
  const auto [y_plain, dx_plain] = step(*plain, x, dy);
  const auto [y_last, dx_last] = step(*last, x, dy);
  // No batch norm and no pooling: the CPU's channels-last convolution is its NCHW one.
  CHECK(same_bits(y_last, y_plain));
  CHECK(same_bits(dx_last, dx_plain));
  require_same_bits(*plain, *last);
}

// Note [16-bit activations] in tensor/ops.h, with the compute float32: the CPU has no bfloat16
// convolutions to multiply in, and the storage is what is tested here (each op's arithmetic on
// it: test_tensor_ops [storage16]). The outputs are compared, not the gradients: this little
// resnet18 amplifies a perturbation of its activations ~1e4-fold into its gradients (one
// float32 ulp moved them by 2e-3, above), so bfloat16 rounding alone moves them by tens of
// percent; the GPU kernels are compared with these CPU ones on the same rounding instead
// (test_models_cuda [storage16]). The outputs' own gap is bfloat16's rounding (2^-9) carried
// through 20 layers: 2.07e-2 on the Intel AMX VM (docs/benchmarks.md), under 2e-2 on the AVX2
// ones; a storage path that lost or mixed values would be off by its whole scale.
TEST_CASE("set_activation_dtype: resnet18 passes bfloat16 activations on, every gradient in its activation's type",
          "[storage16]") {
  std::mt19937_64 rng(17);
  const Tensor x = uniform_tensor({8, 1, 28, 28}, rng);
  const Tensor dy = uniform_tensor({8, 10}, rng);
  const bool others = GENERATE(false, true);
  CAPTURE(others);
  auto plain = resnet18();
  auto narrow = resnet18();
  mtrain::testing::SoloGroup solo;
  if (others) {
    fuse_batchnorm(*narrow);
    skip_conv_bias(*plain);
    skip_conv_bias(*narrow);
    convert_sync_batchnorm(*narrow, solo.group);
    use_channels_last(*narrow);
  }
  const ActivationStorage storage = set_activation_dtype(*narrow, DType::BFloat16);
  CHECK(storage.refused.empty());
  CHECK(storage.convolutions == 20);
  auto& stem = dynamic_cast<Conv2d&>(narrow->child(0).child(0));
  const Tensor stem_out = stem.forward(x);
  CHECK(stem_out.dtype() == DType::BFloat16);
  stem.backward(Tensor::zeros(stem_out.shape(), DType::BFloat16));
  for (int i = 0; i < 2; ++i) {
    const auto [y_plain, dx_plain] = step(*plain, x, dy, 1e-4f);
    const auto [y_narrow, dx_narrow] = step(*narrow, x, dy, 1e-4f);
    CHECK(y_narrow.dtype() == DType::Float32);   // Linear's output, for the loss
    CHECK(dx_narrow.dtype() == DType::Float32);  // the images' type
    CHECK(relative_gap(y_narrow, y_plain) < 5e-2);
    for_each_state(*plain, *narrow, [](const std::string& name, const Tensor& a, const Tensor& b) {
      INFO(name);
      CHECK(b.dtype() == a.dtype());  // parameters, their gradients and the statistics keep theirs
      CHECK(b.shape() == a.shape());
    });
  }
  narrow->eval();
  plain->eval();
  CHECK(relative_gap(narrow->forward(x), plain->forward(x)) < 5e-2);
  // Float32 undoes it: a float32 output again.
  CHECK(set_activation_dtype(*narrow, DType::Float32).convolutions == 20);
  CHECK(stem.forward(x).dtype() == DType::Float32);
}

TEST_CASE("set_activation_dtype names the layer that takes float32 only and changes nothing", "[storage16]") {
  auto odd = make_sequential(std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 1, .out_channels = 2}),
                             std::make_unique<Sigmoid>());
  const ActivationStorage storage = set_activation_dtype(*odd, DType::BFloat16);
  CHECK(storage.convolutions == 0);
  CHECK_THAT(storage.refused, Catch::Contains("Sigmoid (1) takes float32 activations only"));
  CHECK(dynamic_cast<Conv2d&>(odd->child(0)).activation_dtype() == DType::Float32);
  CHECK_THROWS_AS(set_activation_dtype(*odd, DType::Int32), InvalidArgument);
  // The images are float32 and the loss takes float32 logits.
  auto relu_first = make_sequential(std::make_unique<ReLU>(),
                                    std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 1, .out_channels = 2}),
                                    std::make_unique<Flatten>(), std::make_unique<Linear>(2, 3));
  CHECK_THAT(set_activation_dtype(*relu_first, DType::BFloat16).refused,
             Catch::Contains("the images go to a ReLU first, not a convolution"));
  auto no_linear = make_sequential(std::make_unique<Conv2d>(Conv2dOptions{.in_channels = 1, .out_channels = 2}),
                                   std::make_unique<AdaptiveAvgPool2d>(1), std::make_unique<Flatten>());
  const ActivationStorage refused = set_activation_dtype(*no_linear, DType::BFloat16);
  CHECK_THAT(refused.refused, Catch::Contains("ends in a Flatten, not a Linear"));
  CHECK(refused.convolutions == 0);
  CHECK(dynamic_cast<Conv2d&>(no_linear->child(0)).activation_dtype() == DType::Float32);
}
