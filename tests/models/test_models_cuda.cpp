// gpu: every layer, the loss, SyncBatchNorm, resnet18 and lenet on a GPU against the
// same modules on the CPU (same weights, same inputs), Module::to round trips, and the
// per-channel batch-norm ops. Skips the whole binary without a usable GPU.
//
// Tolerances (GPU value g against CPU value c, per element: |g - c| <= atol + rtol*|c|,
// with atol a fraction of the largest |c| of that tensor, so that an element that
// cancels to near zero is judged against the tensor's scale; for a layer's parameter
// gradients, of the largest |c| of all of them):
//   kExact       ReLU, Hardtanh, Hardsigmoid, Hardswish, max pooling, Flatten and the
//                per-channel batch-norm ops: the GPU
//                performs the CPU's float operations one for one (the channel kernels
//                use round-to-nearest intrinsics for exactly this), so bits must agree.
//   kElementwise Sigmoid: CUDA's expf and glibc's exp are each within 2 ulp, so
//                1e-6 relative (8 ulp) is generous and still far below a wrong formula;
//                the gradient s * (1 - s) cancels where s is near 1 (an H200 was 1.8e-5
//                relative off there), so 1e-6 of the tensor's largest value on top.
//   kReduction   average pooling and batch norm: sums of up to a few hundred float32
//                terms, added in another order; the rounding error is below
//                n * 2^-24 ~ 1e-5 of the sum of magnitudes for n <= 100 terms in a row.
//   kGemm        Conv2d, Linear and Residual with TF32 off (cuda_ops::set_numerics):
//                full float32 products, but cuDNN/cuBLAS block the K <= 600 term sums
//                differently; typical error sqrt(K) * 2^-24 ~ 1.5e-6 of the terms'
//                magnitude, so 1e-4 leaves room for cancellation and still fails a
//                kernel that drops, doubles or misplaces a single term (an O(1e-2..1)
//                relative error on these random inputs).
//   kModel       resnet18/lenet outputs and buffers, and lenet's gradients and SGD
//                updates, after a whole forward and backward: the per-layer errors
//                above compound through the layers; 2e-3 is still two orders of
//                magnitude below what one wrong layer produces.
//   Note [resnet18's gradients in norm]: a ReLU whose input is within rounding of zero
//   passes or stops its gradient depending on the last bit, and a batch norm spreads one
//   such element over its whole channel, so two float32 implementations can disagree by
//   percents in single elements (on one CPU, PyTorch's float32 gradient of a batch norm
//   bias was 1.3e-2 of the tensor's largest value away from float64, mtrain's CPU the
//   same; scripts/check_gradients_torch.py; on an H200 mtrain's GPU flipped two in
//   stage 4, docs/benchmarks.md). So resnet18's gradients and updates are
//   compared as whole tensors here: ||g - c|| <= kModelNorm * ||c|| + 1e-4 * the
//   largest ||c|| of the model (the floor for a convolution's bias ahead of batch norm,
//   zero up to rounding). A mis-wired layer or optimizer is off by O(1); the layer tests
//   above hold each kernel to kGemm element by element.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/layers.h"
#include "models/mixed_precision.h"
#include "models/optim.h"
#include "models/zoo.h"
#include "tensor/cuda_devices.h"
#include "tests/models/grad_check.h"
#include "tests/support/skip.h"

#ifdef MTRAIN_HAVE_CUDA
#include "collectives/process_group.h"
#include "store/store.h"
#include "models/sync_batchnorm.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_ops.h"
#include "tensor/ops.h"
#include "tests/support/stream_gate.h"
#endif

using namespace mtrain;
using namespace mtrain::models;
using namespace mtrain::models::testing;

#ifdef MTRAIN_HAVE_CUDA

namespace {

const Device kGpu = Device::cuda(0);

void require_gpu() {
  if (cuda_info().device_count == 0) mtrain::testing::skip_test_binary(cuda_summary().c_str());
  // Full float32 for cuDNN and cuBLAS: the comparisons below are against float32 CPU
  // kernels, and TF32's 10-bit mantissa would need tolerances too loose to catch much.
  cuda_ops::NumericsOptions numerics;
  numerics.allow_tf32 = false;
  numerics.allow_tf32_matmul = false;
  cuda_ops::set_numerics(numerics);
}

struct Tolerance {
  double rtol;
  double atol_scale;  // atol = atol_scale * max |CPU value| of the tensor
};
constexpr Tolerance kExact{0.0, 0.0};
constexpr Tolerance kElementwise{1e-6, 1e-6};
constexpr Tolerance kReduction{1e-5, 1e-6};
constexpr Tolerance kGemm{1e-4, 1e-4};
constexpr Tolerance kModel{2e-3, 2e-3};
constexpr double kModelNorm = 5e-2;

// Empty when every element is within tolerance, else the worst element.
std::string mismatch(const std::vector<double>& gpu, const std::vector<double>& cpu,
                     Tolerance tol, double scale_floor) {
  if (gpu.size() != cpu.size()) {
    return fmt::format("{} GPU values against {} CPU values", gpu.size(), cpu.size());
  }
  double scale = scale_floor;
  for (double c : cpu) scale = std::max(scale, std::abs(c));
  const double atol = tol.atol_scale * scale;
  double worst_excess = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double g = gpu[i], c = cpu[i];
    if (std::isnan(g) || std::isnan(c)) {
      if (std::isnan(g) && std::isnan(c)) continue;
      return fmt::format("element {}: GPU {} vs CPU {}", i, g, c);
    }
    const double excess = std::abs(g - c) - (atol + tol.rtol * std::abs(c));
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (worst_excess <= 0.0) return "";
  return fmt::format("element {} of {}: GPU {} vs CPU {} (rtol {}, atol {})", worst, gpu.size(),
                     gpu[worst], cpu[worst], tol.rtol, atol);
}

std::vector<double> values_of(const Tensor& t) {
  std::vector<double> out;
  if (t.dtype() == DType::Int64) {
    for (int64_t v : t.to_vector<int64_t>()) out.push_back(static_cast<double>(v));
  } else {
    for (float v : t.to_vector<float>()) out.push_back(v);
  }
  return out;
}

// scale_floor: the least scale for atol (check_state's gradients pass the module's
// largest, since a convolution's bias ahead of batch norm has a gradient that is zero up
// to rounding and no scale of its own).
void check_close(const std::string& what, const Tensor& gpu, const Tensor& cpu, Tolerance tol,
                 double scale_floor = 0.0) {
  INFO(what);
  REQUIRE(gpu.defined());
  REQUIRE(cpu.defined());
  CHECK(gpu.device() == kGpu);
  CHECK(cpu.device() == Device::cpu());
  REQUIRE(gpu.shape() == cpu.shape());
  REQUIRE(gpu.dtype() == cpu.dtype());
  const std::string failure = mismatch(values_of(gpu), values_of(cpu), tol, scale_floor);
  INFO(failure);
  CHECK(failure.empty());
}

// The same module twice from one seed: one stays on the CPU, one moves to the GPU.
struct ModulePair {
  std::unique_ptr<Module> cpu;
  std::unique_ptr<Module> gpu;
};

ModulePair make_pair_of(const std::function<std::unique_ptr<Module>()>& make, uint64_t seed) {
  ModulePair pair{make(), make()};
  init_parameters(*pair.cpu, {.seed = seed});
  init_parameters(*pair.gpu, {.seed = seed});
  pair.gpu->to(kGpu);
  return pair;
}

// Parameter gradients and buffers of the two modules.
void check_state(const std::string& what, Module& gpu, Module& cpu, Tolerance tol) {
  const auto gpu_params = gpu.parameters(), cpu_params = cpu.parameters();
  REQUIRE(gpu_params.size() == cpu_params.size());
  double largest = 0.0;
  for (const NamedParameter& p : cpu_params) {
    for (double v : values_of(p.param->grad)) largest = std::max(largest, std::abs(v));
  }
  for (size_t i = 0; i < gpu_params.size(); ++i) {
    check_close(what + " grad of " + cpu_params[i].name, gpu_params[i].param->grad,
                cpu_params[i].param->grad, tol, largest);
  }
  const auto gpu_buffers = gpu.buffers(), cpu_buffers = cpu.buffers();
  REQUIRE(gpu_buffers.size() == cpu_buffers.size());
  for (size_t i = 0; i < gpu_buffers.size(); ++i) {
    check_close(what + " buffer " + cpu_buffers[i].name, *gpu_buffers[i].buffer,
                *cpu_buffers[i].buffer, tol);
  }
}

// One forward and backward of both modules on `x` with the same random output gradient;
// compares the output, the input gradient, every parameter gradient and every buffer.
void check_forward_backward(const std::string& what, ModulePair& pair, const Tensor& x,
                            std::mt19937_64& rng, Tolerance tol) {
  pair.cpu->zero_grad();
  pair.gpu->zero_grad();
  const Tensor y_cpu = pair.cpu->forward(x);
  const Tensor y_gpu = pair.gpu->forward(x.to(kGpu));
  check_close(what + " output", y_gpu, y_cpu, tol);
  const Tensor dy = uniform_tensor(y_cpu.shape(), rng);
  const Tensor dx_cpu = pair.cpu->backward(dy);
  const Tensor dx_gpu = pair.gpu->backward(dy.to(kGpu));
  check_close(what + " input gradient", dx_gpu, dx_cpu, tol);
  check_state(what, *pair.gpu, *pair.cpu, tol);
}

std::unique_ptr<Module> conv(int64_t in, int64_t out, int kernel, int stride, int padding,
                             bool bias) {
  return std::make_unique<Conv2d>(Conv2dOptions{.in_channels = in,
                                                .out_channels = out,
                                                .kernel_size = kernel,
                                                .stride = stride,
                                                .padding = padding,
                                                .bias = bias});
}

}  // namespace

TEST_CASE("Conv2d and Linear on the GPU equal the CPU", "[cuda][layers]") {
  require_gpu();
  std::mt19937_64 rng(1);
  {
    auto pair = make_pair_of([] { return conv(3, 8, 3, 1, 1, true); }, 11);
    check_forward_backward("Conv2d 3x3", pair, uniform_tensor({4, 3, 9, 9}, rng), rng, kGemm);
  }
  {
    auto pair = make_pair_of([] { return conv(5, 4, 5, 2, 2, false); }, 12);
    check_forward_backward("Conv2d 5x5 stride 2 no bias", pair, uniform_tensor({3, 5, 11, 7}, rng),
                           rng, kGemm);
  }
  {
    // cuDNN's group count against oneDNN's grouped weights (goihw), and a depthwise layer.
    auto pair = make_pair_of(
        [] {
          return std::make_unique<Conv2d>(
              Conv2dOptions{.in_channels = 8, .out_channels = 12, .kernel_size = 3, .stride = 2, .padding = 1, .groups = 4});
        },
        14);
    check_forward_backward("Conv2d 3x3 in 4 groups", pair, uniform_tensor({3, 8, 9, 9}, rng), rng, kGemm);
    auto depthwise = make_pair_of(
        [] {
          return std::make_unique<Conv2d>(Conv2dOptions{
              .in_channels = 16, .out_channels = 16, .kernel_size = 3, .padding = 1, .bias = false, .groups = 16});
        },
        15);
    check_forward_backward("Conv2d 3x3 depthwise", depthwise, uniform_tensor({3, 16, 8, 8}, rng), rng, kGemm);
    // Inception's rectangular windows: a 1x7 kernel padded along the width only, and another
    // stride along each axis.
    auto wide = make_pair_of(
        [] {
          return std::make_unique<Conv2d>(Conv2dOptions{
              .in_channels = 6, .out_channels = 5, .kernel_size = 1, .padding = 0, .kernel_w = 7, .stride_w = 2, .padding_w = 3});
        },
        16);
    check_forward_backward("Conv2d 1x7", wide, uniform_tensor({3, 6, 9, 11}, rng), rng, kGemm);
    auto atrous = make_pair_of(
        [] {
          return std::make_unique<Conv2d>(
              Conv2dOptions{.in_channels = 6, .out_channels = 8, .kernel_size = 3, .padding = 2, .dilation = 2});
        },
        17);
    check_forward_backward("Conv2d dilated", atrous, uniform_tensor({3, 6, 9, 10}, rng), rng, kGemm);
  }
  {
    auto pair = make_pair_of([] { return std::make_unique<Linear>(37, 13); }, 13);
    check_forward_backward("Linear", pair, uniform_tensor({6, 37}, rng), rng, kGemm);
  }
  {
    auto pair = make_pair_of([] { return std::make_unique<Linear>(8, 5, false); }, 14);
    check_forward_backward("Linear no bias", pair, uniform_tensor({3, 8}, rng), rng, kGemm);
  }
  // The first layer of a model skips its input gradient (Module::set_input_grad_needed).
  auto pair = make_pair_of([] { return conv(1, 4, 3, 1, 1, true); }, 15);
  pair.gpu->set_input_grad_needed(false);
  pair.gpu->forward(uniform_tensor({2, 1, 6, 6}, rng).to(kGpu));
  CHECK_FALSE(pair.gpu->backward(uniform_tensor({2, 4, 6, 6}, rng).to(kGpu)).defined());
}

TEST_CASE("activations, pooling and Flatten on the GPU equal the CPU", "[cuda][layers]") {
  require_gpu();
  std::mt19937_64 rng(2);
  {
    auto pair = make_pair_of([] { return std::make_unique<ReLU>(); }, 0);
    check_forward_backward("ReLU", pair, away_from_zero_tensor({3, 4, 5, 6}, rng), rng, kExact);
  }
  {
    auto pair = make_pair_of([] { return std::make_unique<Sigmoid>(); }, 0);
    check_forward_backward("Sigmoid", pair, uniform_tensor({7, 33}, rng, -6.0f, 6.0f), rng,
                           kElementwise);
  }
  // GELU's parts (CUDA's erff and expf against glibc's, as the sigmoid's), LayerNorm and
  // ChannelScale (double sums in another order), Linear over rows of a 4-D input.
  {
    auto erf = make_pair_of([] { return std::make_unique<Erf>(); }, 0);
    check_forward_backward("Erf", erf, uniform_tensor({7, 33}, rng, -3.0f, 3.0f), rng, kElementwise);
    auto affine = make_pair_of([] { return std::make_unique<Affine>(0.70710678f, 1.0f); }, 0);
    check_forward_backward("Affine", affine, uniform_tensor({7, 33}, rng), rng, kExact);
    auto norm = make_pair_of([] { return std::make_unique<LayerNorm>(96, 1e-6f); }, 0);
    check_forward_backward("LayerNorm", norm, uniform_tensor({2, 5, 7, 96}, rng), rng, kReduction);
    auto scale = make_pair_of([] { return std::make_unique<ChannelScale>("layer_scale", Shape{6, 1, 1}); }, 0);
    check_forward_backward("ChannelScale", scale, uniform_tensor({3, 6, 5, 7}, rng), rng, kReduction);
    auto rows = make_pair_of([] { return std::make_unique<Linear>(24, 40); }, 18);
    check_forward_backward("Linear over rows", rows, uniform_tensor({2, 3, 5, 24}, rng), rng, kGemm);
  }
  // The same float operations one for one (round-to-nearest intrinsics on the GPU).
  {
    auto pair = make_pair_of([] { return std::make_unique<Hardtanh>(0.0f, 6.0f); }, 0);
    check_forward_backward("Hardtanh", pair, uniform_tensor({3, 4, 5, 6}, rng, -3.0f, 9.0f), rng, kExact);
  }
  {
    auto pair = make_pair_of([] { return std::make_unique<Hardsigmoid>(); }, 0);
    check_forward_backward("Hardsigmoid", pair, uniform_tensor({3, 4, 5, 6}, rng, -5.0f, 5.0f), rng, kExact);
  }
  {
    auto pair = make_pair_of([] { return std::make_unique<Hardswish>(); }, 0);
    check_forward_backward("Hardswish", pair, uniform_tensor({3, 4, 5, 6}, rng, -5.0f, 5.0f), rng, kExact);
  }
  {
    // Distinct values: the argmax of every window is unambiguous.
    auto pair = make_pair_of(
        [] {
          return std::make_unique<MaxPool2d>(
              Pool2dOptions{.kernel_size = 3, .stride = 2, .padding = 1});
        },
        0);
    check_forward_backward("MaxPool2d", pair, distinct_values_tensor({2, 3, 7, 9}, rng), rng,
                           kExact);
    auto ceil = make_pair_of(
        [] { return std::make_unique<MaxPool2d>(Pool2dOptions{.kernel_size = 3, .stride = 2, .ceil_mode = true}); },
        0);
    check_forward_backward("MaxPool2d ceil_mode", ceil, distinct_values_tensor({2, 3, 14, 9}, rng), rng, kExact);
  }
  {
    auto pair = make_pair_of(
        [] { return std::make_unique<AvgPool2d>(Pool2dOptions{.kernel_size = 2}); }, 0);
    check_forward_backward("AvgPool2d", pair, uniform_tensor({2, 3, 8, 6}, rng), rng, kReduction);
  }
  {
    auto pair = make_pair_of(
        [] {
          return std::make_unique<AvgPool2d>(
              Pool2dOptions{.kernel_size = 3, .stride = 2, .padding = 1});
        },
        0);
    check_forward_backward("AvgPool2d padded", pair, uniform_tensor({2, 2, 7, 7}, rng), rng,
                           kReduction);
  }
  {
    auto pair = make_pair_of([] { return std::make_unique<AdaptiveAvgPool2d>(1); }, 0);
    check_forward_backward("AdaptiveAvgPool2d", pair, uniform_tensor({3, 5, 7, 7}, rng), rng,
                           kReduction);
  }
  {
    auto pair = make_pair_of([] { return std::make_unique<Flatten>(); }, 0);
    check_forward_backward("Flatten", pair, uniform_tensor({3, 2, 4, 5}, rng), rng, kExact);
  }
}

TEST_CASE("BatchNorm2d on the GPU equals the CPU in training and eval", "[cuda][batchnorm]") {
  require_gpu();
  std::mt19937_64 rng(3);
  auto pair = make_pair_of([] { return std::make_unique<BatchNorm2d>(6); }, 0);
  // Non-trivial affine parameters, the same on both.
  const Tensor gamma = uniform_tensor({6}, rng, 0.5f, 2.0f);
  const Tensor beta = uniform_tensor({6}, rng);
  for (Module* m : {pair.cpu.get(), pair.gpu.get()}) {
    auto& bn = dynamic_cast<BatchNorm2d&>(*m);
    bn.weight().value.copy_(gamma);
    bn.bias().value.copy_(beta);
  }
  for (int step = 0; step < 3; ++step) {
    // An offset and spread per batch, so the running statistics move.
    check_forward_backward(fmt::format("BatchNorm2d train step {}", step), pair,
                           uniform_tensor({5, 6, 4, 3}, rng, -1.0f + step, 3.0f + 2 * step), rng,
                           kReduction);
  }
  CHECK(dynamic_cast<BatchNorm2d&>(*pair.gpu).num_batches_tracked() == 3);
  pair.cpu->eval();
  pair.gpu->eval();
  check_forward_backward("BatchNorm2d eval", pair, uniform_tensor({2, 6, 3, 3}, rng), rng,
                         kReduction);
  CHECK(dynamic_cast<BatchNorm2d&>(*pair.gpu).num_batches_tracked() == 3);
  // Eval with an empty batch still works (no statistics are taken).
  const Tensor empty = pair.gpu->forward(Tensor::empty({0, 6, 3, 3}, DType::Float32, kGpu));
  CHECK(empty.device() == kGpu);
  CHECK(empty.shape() == Shape{0, 6, 3, 3});
  // Training with one value per channel is the same error as on the CPU.
  pair.gpu->train();
  CHECK_THROWS_AS(pair.gpu->forward(Tensor::zeros({1, 6, 1, 1}, DType::Float32, kGpu)),
                  InvalidArgument);
}

TEST_CASE("Residual blocks on the GPU equal the CPU", "[cuda][layers]") {
  require_gpu();
  std::mt19937_64 rng(4);
  {
    auto pair = make_pair_of([] { return std::make_unique<Residual>(4, 4); }, 21);
    check_forward_backward("Residual identity", pair, uniform_tensor({3, 4, 6, 6}, rng), rng,
                           kGemm);
  }
  {
    auto pair = make_pair_of([] { return std::make_unique<Residual>(3, 5, true, 2); }, 22);
    check_forward_backward("Residual 1x1 conv", pair, uniform_tensor({3, 3, 7, 7}, rng), rng,
                           kGemm);
    pair.cpu->eval();
    pair.gpu->eval();
    check_forward_backward("Residual 1x1 conv eval", pair, uniform_tensor({2, 3, 7, 7}, rng), rng,
                           kGemm);
  }
}

TEST_CASE("CrossEntropyLoss on the GPU equals the CPU", "[cuda][loss]") {
  require_gpu();
  std::mt19937_64 rng(5);
  const Tensor logits = uniform_tensor({9, 7}, rng, -4.0f, 4.0f);
  const Tensor labels = Tensor::from_vector<int64_t>({0, 6, 3, 3, 1, 2, 5, 4, 0}, {9});
  CrossEntropyLoss cpu_loss, gpu_loss;
  const LossResult on_cpu = cpu_loss.forward(logits, labels).read();
  const LossResult on_gpu = gpu_loss.forward(logits.to(kGpu), labels.to(kGpu)).read();
  // Log-sum-exp of 7 values per row: float32 exp and log, a few ulp apart.
  CHECK(on_gpu.loss == Approx(on_cpu.loss).epsilon(1e-6));
  CHECK(on_gpu.correct == on_cpu.correct);
  CHECK(on_gpu.count == 9);
  check_close("dlogits", gpu_loss.backward(), cpu_loss.backward(), kElementwise);

  CHECK_THROWS_WITH(gpu_loss.forward(logits.to(kGpu), labels),
                    Catch::Contains("the logits are on cuda:0 but the labels are on cpu"));
}

// Note [Loss statistics stay on the device]: reading a forward's figures waits for the
// loss's own kernels and copy, not for what the stream queued after them (the training
// loop queues the whole backward first). A read that waited for the stream would sit
// behind the gate until it opened by itself.
TEST_CASE("a loss is read without waiting for the work queued after it", "[cuda][loss]") {
  require_gpu();
  std::mt19937_64 rng(6);
  const Tensor logits = uniform_tensor({33, 10}, rng, -4.0f, 4.0f);
  std::vector<int64_t> classes(33);
  for (size_t i = 0; i < classes.size(); ++i) classes[i] = static_cast<int64_t>((i * 7) % 10);
  const Tensor labels = Tensor::from_vector<int64_t>(classes, {33});
  const Tensor bad_labels = Tensor::from_vector<int64_t>({3, 1, 12, 0, -2, 5}, {6});
  CrossEntropyLoss cpu_loss, gpu_loss;
  const LossResult expected = cpu_loss.forward(logits, labels).read();

  cuda::OwnedStream side(0);
  const cuda::StreamGuard on_side(side.stream());
  const Tensor g_logits = logits.to(kGpu), g_labels = labels.to(kGpu);
  const Tensor g_bad = bad_labels.to(kGpu), g_bad_logits = g_logits.narrow0(0, 6);
  const PendingLoss pending = gpu_loss.forward(g_logits, g_labels);
  const PendingLoss pending_bad = gpu_loss.value(g_bad_logits, g_bad);
  mtrain::testing::StreamGate gate(side.stream().handle());
  Tensor after = Tensor::empty({1 << 20}, DType::Float32, kGpu);
  after.fill_(3.0f);  // queued behind the gate

  const LossResult got = pending.read();
  CHECK(got.loss == Approx(expected.loss).epsilon(1e-6));
  CHECK(got.correct == expected.correct);
  CHECK(got.count == 33);
  CHECK_FALSE(gate.timed_out());
  gate.open();
  // The error path fetches the bad label itself, a copy that waits for the stream.
  CHECK_THROWS_WITH(pending_bad.read(), Catch::Contains("label 12 of sample 2 is outside [0, 10)"));
  CHECK(after.to_vector<float>() == std::vector<float>(1 << 20, 3.0f));
  check_close("dlogits", gpu_loss.backward(), cpu_loss.backward(), kElementwise);
}

TEST_CASE("a GPU model given a host input names both devices and the fix", "[cuda][layers]") {
  require_gpu();
  auto model = build_model("lenet", 1, 10);
  model->to(kGpu);
  CHECK_THROWS_AS(model->forward(Tensor::zeros({2, 1, 28, 28})), InvalidArgument);
  CHECK_THROWS_WITH(model->forward(Tensor::zeros({2, 1, 28, 28})),
                    Catch::Contains("the input is on cpu but the layer's parameters are on "
                                    "cuda:0") &&
                        Catch::Contains("model.to(cpu)"));
}

TEST_CASE("Module::to round trips between host and GPU", "[cuda][module]") {
  require_gpu();
  std::mt19937_64 rng(6);
  auto model = build_model("resnet18", 1, 10, {.seed = 4});
  model->forward(uniform_tensor({2, 1, 28, 28}, rng));  // non-trivial running statistics
  std::vector<std::string> names;
  std::vector<Parameter*> params;
  std::vector<Tensor> values;
  for (const NamedParameter& p : model->parameters()) {
    names.push_back(p.name);
    params.push_back(p.param);
    values.push_back(p.param->value.clone());
  }
  std::vector<Tensor> buffers;
  for (const NamedBuffer& b : model->buffers()) buffers.push_back(b.buffer->clone());

  model->to(kGpu);
  for (const NamedParameter& p : model->parameters()) {
    CHECK(p.param->value.device() == kGpu);
    CHECK(p.param->grad.device() == kGpu);
  }
  for (const NamedBuffer& b : model->buffers()) CHECK(b.buffer->device() == kGpu);
  // Already there: nothing is copied.
  const Tensor first_weight = model->parameters()[0].param->value;
  model->to(kGpu);
  CHECK(model->parameters()[0].param->value.shares_storage_with(first_weight));

  model->to(Device::cpu());
  size_t i = 0;
  for (const NamedParameter& p : model->parameters()) {
    INFO(p.name);
    CHECK(p.name == names[i]);
    CHECK(p.param == params[i]);
    CHECK(p.param->value.device() == Device::cpu());
    CHECK(p.param->value.to_vector<float>() == values[i].to_vector<float>());
    ++i;
  }
  i = 0;
  for (const NamedBuffer& b : model->buffers()) {
    INFO(b.name);
    CHECK(b.buffer->device() == Device::cpu());
    CHECK(values_of(*b.buffer) == values_of(buffers[i++]));
  }
}

TEST_CASE("initialising a model already on the GPU gives the CPU's weights", "[cuda][module]") {
  require_gpu();
  auto cpu_model = build_model("simplecnn", 3, 10, {.seed = 9});
  auto gpu_model = build_model("simplecnn", 3, 10, {.seed = 1});
  gpu_model->to(kGpu);
  init_parameters(*gpu_model, {.seed = 9});
  const auto gpu_params = gpu_model->parameters(), cpu_params = cpu_model->parameters();
  for (size_t i = 0; i < gpu_params.size(); ++i) {
    check_close(cpu_params[i].name, gpu_params[i].param->value, cpu_params[i].param->value,
                kExact);
  }
}

namespace {

// A training step of `name` on both devices from the same weights: forward, loss,
// backward and one SGD step with momentum and weight decay. Compares logits, loss,
// gradients, buffers and the parameter updates.
// ||gpu - cpu|| <= rtol * ||cpu|| + floor (Note [resnet18's gradients in norm]).
void check_close_in_norm(const std::string& what, const Tensor& gpu, const Tensor& cpu,
                         double rtol, double floor) {
  INFO(what);
  REQUIRE(gpu.shape() == cpu.shape());
  const std::vector<double> g = values_of(gpu), c = values_of(cpu);
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < c.size(); ++i) {
    diff += (g[i] - c[i]) * (g[i] - c[i]);
    norm += c[i] * c[i];
  }
  diff = std::sqrt(diff);
  norm = std::sqrt(norm);
  INFO("||GPU - CPU|| " << diff << ", ||CPU|| " << norm << ", allowed " << rtol * norm + floor);
  CHECK(diff <= rtol * norm + floor);
}

double largest_norm(const std::vector<Tensor>& tensors) {
  double largest = 0.0;
  for (const Tensor& t : tensors) {
    double s = 0.0;
    for (double v : values_of(t)) s += v * v;
    largest = std::max(largest, std::sqrt(s));
  }
  return largest;
}

enum class GradientCheck { Elementwise, InNorm };

// `rewrite` changes the GPU model's way of computing (models/rewrites.h), not its function.
void check_model_step(const std::string& name, int batch, GradientCheck how,
                      const std::function<void(Module&)>& rewrite = {}) {
  std::mt19937_64 rng(7);
  auto pair = make_pair_of([&] { return build_model(name, 1, 10); }, 17);
  if (rewrite) rewrite(*pair.gpu);
  const SgdOptions options{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 5e-4f};
  Sgd cpu_opt(*pair.cpu, options), gpu_opt(*pair.gpu, options);
  std::vector<Tensor> before;
  for (const NamedParameter& p : pair.cpu->parameters()) before.push_back(p.param->value.clone());

  const Tensor x = uniform_tensor({batch, 1, 28, 28}, rng);
  std::vector<int64_t> label_values;
  for (int i = 0; i < batch; ++i) label_values.push_back(i % 10);
  const Tensor labels = Tensor::from_vector(label_values, {batch});
  CrossEntropyLoss cpu_loss, gpu_loss;
  cpu_opt.zero_grad();
  gpu_opt.zero_grad();
  const Tensor logits_cpu = pair.cpu->forward(x);
  const Tensor logits_gpu = pair.gpu->forward(x.to(kGpu));
  check_close(name + " logits", logits_gpu, logits_cpu, kModel);
  const LossResult l_cpu = cpu_loss.forward(logits_cpu, labels).read();
  const LossResult l_gpu = gpu_loss.forward(logits_gpu, labels.to(kGpu)).read();
  CHECK(l_gpu.loss == Approx(l_cpu.loss).epsilon(kModel.rtol));
  pair.cpu->backward(cpu_loss.backward());
  pair.gpu->backward(gpu_loss.backward());
  const auto compare = [&](const std::string& what, const std::vector<Tensor>& gpu,
                           const std::vector<Tensor>& cpu) {
    const double floor = 1e-4 * largest_norm(cpu);
    for (size_t i = 0; i < cpu.size(); ++i) {
      const std::string tensor = what + pair.cpu->parameters()[i].name;
      if (how == GradientCheck::InNorm) {
        check_close_in_norm(tensor, gpu[i], cpu[i], kModelNorm, floor);
      } else {
        check_close(tensor, gpu[i], cpu[i], kModel);
      }
    }
  };
  std::vector<Tensor> gpu_grads, cpu_grads;
  for (const NamedParameter& p : pair.gpu->parameters()) gpu_grads.push_back(p.param->grad);
  for (const NamedParameter& p : pair.cpu->parameters()) cpu_grads.push_back(p.param->grad);
  compare(name + " grad of ", gpu_grads, cpu_grads);
  const auto gpu_buffers = pair.gpu->buffers(), cpu_buffers = pair.cpu->buffers();
  REQUIRE(gpu_buffers.size() == cpu_buffers.size());
  for (size_t i = 0; i < gpu_buffers.size(); ++i) {
    check_close(name + " buffer " + cpu_buffers[i].name, *gpu_buffers[i].buffer,
                *cpu_buffers[i].buffer, kModel);
  }

  cpu_opt.step();
  gpu_opt.step();
  for (const Tensor& buf : gpu_opt.momentum_buffers()) CHECK(buf.device() == kGpu);
  // The update lr * (grad + weight_decay * param), on each side: the parameters
  // themselves are large next to it, so comparing them would hide a wrong update.
  const auto cpu_params = pair.cpu->parameters(), gpu_params = pair.gpu->parameters();
  std::vector<Tensor> gpu_updates, cpu_updates;
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    Tensor cpu_update = before[i].clone(), gpu_update = before[i].to(kGpu);
    ops::add_(cpu_update, cpu_params[i].param->value, -1.0f);
    ops::add_(gpu_update, gpu_params[i].param->value, -1.0f);
    cpu_updates.push_back(cpu_update);
    gpu_updates.push_back(gpu_update);
  }
  compare(name + " update of ", gpu_updates, cpu_updates);
}

}  // namespace

TEST_CASE("lenet: a training step on the GPU equals the CPU's", "[cuda][zoo]") {
  require_gpu();
  check_model_step("lenet", 16, GradientCheck::Elementwise);
}

TEST_CASE("resnet18: a training step on the GPU equals the CPU's", "[cuda][zoo]") {
  require_gpu();
  check_model_step("resnet18", 8, GradientCheck::InNorm);
}

// Note [Speed switches] in core/speedups.h: each way of computing a GPU step faster keeps
// the CPU's step to the tolerances above.
TEST_CASE("resnet18 with the speed switches and channels last on the GPU equals the CPU's step",
          "[cuda][zoo]") {
  require_gpu();
  const bool graph = GENERATE(false, true);
  CAPTURE(graph);
  cuda_ops::NumericsOptions numerics = cuda_ops::numerics();
  numerics.batchnorm_one_pass = true;
  numerics.cudnn_graph_api = graph;
  cuda_ops::set_numerics(numerics);
  check_model_step("resnet18", 8, GradientCheck::InNorm, [](Module& m) { CHECK(use_channels_last(m) == 39); });
  check_model_step("resnet18", 8, GradientCheck::InNorm, [](Module& m) {
    fuse_batchnorm(m);
    skip_conv_bias(m);
    use_channels_last(m);
  });
  require_gpu();  // back to the file's numerics
}

// Note [16-bit activations] in tensor/ops.h: both models store bfloat16 activations (compute
// float32, which every CPU has), the GPU's in its own 16-bit kernels, the CPU's on float32
// copies. Each kernel is compared exactly in tests/tensor (test_cuda_kernels,
// test_cuda_conv_matmul [storage16]); here the whole model. A float32 value an ulp apart on
// the two devices can round to neighbouring bfloat16 values, 2^-8 apart, and this resnet18
// amplifies such a difference in an activation ~1e4-fold into the early layers' gradients
// (tests/models/test_rewrites.cpp), so those are held to their size, not their values; the
// outputs, the loss and the last layer's gradient, which see no batch norm's backward, are
// compared.
TEST_CASE("resnet18 with bfloat16 activations on the GPU gives the CPU's outputs", "[cuda][zoo][storage16]") {
  require_gpu();
  const bool rewritten = GENERATE(false, true);
  CAPTURE(rewritten);
  std::mt19937_64 rng(7);
  auto pair = make_pair_of([&] { return build_model("resnet18", 1, 10); }, 17);
  for (Module* m : {pair.cpu.get(), pair.gpu.get()}) {
    if (rewritten) {
      fuse_batchnorm(*m);
      skip_conv_bias(*m);
      use_channels_last(*m);
    }
    CHECK(set_activation_dtype(*m, DType::BFloat16).convolutions == 20);
  }
  const int batch = 8;
  const Tensor x = uniform_tensor({batch, 1, 28, 28}, rng);
  std::vector<int64_t> label_values;
  for (int i = 0; i < batch; ++i) label_values.push_back(i % 10);
  const Tensor labels = Tensor::from_vector(label_values, {batch});
  const auto gap = [](const Tensor& gpu, const Tensor& cpu) {
    const std::vector<double> g = values_of(gpu), c = values_of(cpu);
    double apart = 0.0, size = 0.0;
    for (size_t i = 0; i < c.size(); ++i) {
      apart += (g[i] - c[i]) * (g[i] - c[i]);
      size += c[i] * c[i];
    }
    return std::sqrt(apart / std::max(size, 1e-30));
  };
  CrossEntropyLoss cpu_loss, gpu_loss;
  pair.cpu->zero_grad();
  pair.gpu->zero_grad();
  const Tensor logits_cpu = pair.cpu->forward(x);
  const Tensor logits_gpu = pair.gpu->forward(x.to(kGpu));
  CHECK(logits_gpu.dtype() == DType::Float32);
  CHECK(gap(logits_gpu, logits_cpu) < 2e-2);
  const LossResult l_cpu = cpu_loss.forward(logits_cpu, labels).read();
  const LossResult l_gpu = gpu_loss.forward(logits_gpu, labels.to(kGpu)).read();
  CHECK(l_gpu.loss == Approx(l_cpu.loss).epsilon(2e-2));
  pair.cpu->backward(cpu_loss.backward());
  pair.gpu->backward(gpu_loss.backward());
  const auto cpu_params = pair.cpu->parameters(), gpu_params = pair.gpu->parameters();
  REQUIRE(cpu_params.size() == gpu_params.size());
  double cpu_size = 0.0, gpu_size = 0.0;
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    INFO(cpu_params[i].name);
    const Tensor& g = gpu_params[i].param->grad;
    CHECK((g.dtype() == DType::Float32 && g.device() == kGpu));
    for (const double v : values_of(g)) {
      REQUIRE(std::isfinite(v));
      gpu_size += v * v;
    }
    for (const double v : values_of(cpu_params[i].param->grad)) cpu_size += v * v;
  }
  CHECK(std::sqrt(gpu_size) == Approx(std::sqrt(cpu_size)).epsilon(0.5));
  const std::string fc = cpu_params.back().name;  // the Linear's bias, then its weight before it
  REQUIRE(fc.find("bias") != std::string::npos);
  for (size_t i = cpu_params.size() - 2; i < cpu_params.size(); ++i) {
    INFO(cpu_params[i].name);
    CHECK(gap(gpu_params[i].param->grad, cpu_params[i].param->grad) < 5e-2);
  }
}

TEST_CASE("the per-channel batch-norm ops on the GPU equal the CPU's bit for bit",
          "[cuda][batchnorm]") {
  require_gpu();
  std::mt19937_64 rng(8);
  const int64_t c = 300;  // more than one block of threads
  const Tensor var = uniform_tensor({c}, rng, 0.0f, 4.0f);
  Tensor invstd_cpu = Tensor::empty({c});
  Tensor invstd_gpu = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_invstd(var, 1e-5, invstd_cpu);
  ops::batchnorm_invstd(var.to(kGpu), 1e-5, invstd_gpu);
  check_close("batchnorm_invstd", invstd_gpu, invstd_cpu, kExact);

  const Tensor mean = uniform_tensor({c}, rng);
  Tensor rm_cpu = uniform_tensor({c}, rng), rv_cpu = uniform_tensor({c}, rng, 0.5f, 2.0f);
  Tensor rm_gpu = rm_cpu.to(kGpu), rv_gpu = rv_cpu.to(kGpu);
  Tensor tracked_cpu = Tensor::zeros({}, DType::Int64);
  Tensor tracked_gpu = Tensor::zeros({}, DType::Int64, kGpu);
  for (int step = 0; step < 2; ++step) {
    ops::batchnorm_update_running(mean, var, 37, 0.1, rm_cpu, rv_cpu, tracked_cpu);
    ops::batchnorm_update_running(mean.to(kGpu), var.to(kGpu), 37, 0.1, rm_gpu, rv_gpu,
                                  tracked_gpu);
  }
  check_close("running_mean", rm_gpu, rm_cpu, kExact);
  check_close("running_var", rv_gpu, rv_cpu, kExact);
  CHECK(tracked_gpu.to_vector<int64_t>() == std::vector<int64_t>{2});

  const Tensor sum_dy = uniform_tensor({c}, rng), sum_dy_xmu = uniform_tensor({c}, rng);
  Tensor dgamma_cpu = uniform_tensor({c}, rng), dbeta_cpu = uniform_tensor({c}, rng);
  Tensor dgamma_gpu = dgamma_cpu.to(kGpu), dbeta_gpu = dbeta_cpu.to(kGpu);
  ops::batchnorm_param_grads(sum_dy, sum_dy_xmu, invstd_cpu, dgamma_cpu, dbeta_cpu);
  ops::batchnorm_param_grads(sum_dy.to(kGpu), sum_dy_xmu.to(kGpu), invstd_gpu, dgamma_gpu,
                             dbeta_gpu);
  check_close("dgamma", dgamma_gpu, dgamma_cpu, kExact);
  check_close("dbeta", dbeta_gpu, dbeta_cpu, kExact);
  Tensor no_grad;
  ops::batchnorm_param_grads(sum_dy.to(kGpu), sum_dy_xmu.to(kGpu), invstd_gpu, no_grad,
                             dbeta_gpu);
  ops::batchnorm_param_grads(sum_dy, sum_dy_xmu, invstd_cpu, no_grad, dbeta_cpu);
  check_close("dbeta without dgamma", dbeta_gpu, dbeta_cpu, kExact);

  // Five ranks with uneven counts; rank 2 is empty and its row is poison.
  const std::vector<float> counts = {3.0f, 17.0f, 0.0f, 1.0f, 250.0f};
  const int64_t world = static_cast<int64_t>(counts.size()), row = 2 * c + 1;
  Tensor rows = uniform_tensor({world, row}, rng, -2.0f, 2.0f);
  float* pr = rows.data<float>();
  for (int64_t r = 0; r < world; ++r) {
    for (int64_t i = c; i < 2 * c; ++i) pr[r * row + i] = std::abs(pr[r * row + i]);
    pr[r * row + 2 * c] = counts[r];
  }
  pr[2 * row] = std::numeric_limits<float>::quiet_NaN();
  Tensor merged_mean_cpu = Tensor::empty({c}), merged_var_cpu = Tensor::empty({c});
  Tensor merged_mean_gpu = Tensor::empty({c}, DType::Float32, kGpu);
  Tensor merged_var_gpu = Tensor::empty({c}, DType::Float32, kGpu);
  ops::batchnorm_merge_stats(rows, merged_mean_cpu, merged_var_cpu);
  ops::batchnorm_merge_stats(rows.to(kGpu), merged_mean_gpu, merged_var_gpu);
  check_close("merged mean", merged_mean_gpu, merged_mean_cpu, kExact);
  check_close("merged var", merged_var_gpu, merged_var_cpu, kExact);
}

TEST_CASE("SyncBatchNorm on a one-GPU NCCL group equals BatchNorm2d on the GPU bit for bit",
          "[cuda][batchnorm]") {
  require_gpu();
  TcpStoreServer server("127.0.0.1", 0, "syncbn-gpu");
  auto store = std::make_shared<TcpStore>("127.0.0.1", server.port(), "syncbn-gpu");
  std::shared_ptr<ProcessGroup> group = create_process_group("nccl", store, 0, 1, kGpu);
  BatchNorm2d plain(4);
  SyncBatchNorm sync(4, group);
  plain.to(kGpu);
  sync.to(kGpu);
  std::mt19937_64 rng(9);
  for (int step = 0; step < 2; ++step) {
    const Tensor x = uniform_tensor({5, 4, 3, 2}, rng, -1.0f, 3.0f).to(kGpu);
    const Tensor dy = uniform_tensor({5, 4, 3, 2}, rng).to(kGpu);
    // One contributing rank: the merge returns its statistics exactly and the sum of
    // one rank's backward sums is those sums (Note [SyncBatchNorm merge]).
    CHECK(sync.forward(x).to_vector<float>() == plain.forward(x).to_vector<float>());
    CHECK(sync.backward(dy).to_vector<float>() == plain.backward(dy).to_vector<float>());
  }
  CHECK(sync.running_mean().to_vector<float>() == plain.running_mean().to_vector<float>());
  CHECK(sync.running_var().to_vector<float>() == plain.running_var().to_vector<float>());
  CHECK(sync.weight().grad.to_vector<float>() == plain.weight().grad.to_vector<float>());
  CHECK(sync.num_batches_tracked() == 2);
  CHECK_THROWS_WITH(sync.forward(Tensor::zeros({1, 4, 1, 1}, DType::Float32, kGpu)),
                    Catch::Contains("expected more than 1 value per channel when training"));
}

#else

TEST_CASE("builds without CUDA explain that moving a model to a GPU needs CUDA") {
  auto model = build_model("lenet", 1, 10);
  CHECK_THROWS_AS(model->to(Device::cuda(0)), InvalidArgument);
  CHECK_THROWS_WITH(model->to(Device::cuda(0)), Catch::Contains("needs a build with CUDA"));
  CHECK(model->parameters()[0].param->value.device() == Device::cpu());
}

#endif
