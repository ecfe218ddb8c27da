#include "models/zoo.h"

#include <functional>
#include <string_view>
#include <utility>

#include "core/error.h"
#include "models/activation.h"
#include "models/batchnorm.h"
#include "models/conv.h"
#include "models/flatten.h"
#include "models/linear.h"
#include "models/onnx/graph_model.h"
#include "models/pooling.h"
#include "models/residual.h"
#include "models/sequential.h"
#include "models/torchvision_resnet.h"

namespace mtrain::models {

namespace {

// The zoo's inputs are 28x28 (Fashion-MNIST, MNIST); models with a flatten straight
// after fixed-size convolutions depend on it.
constexpr int64_t kImageSize = 28;

std::unique_ptr<Conv2d> conv(int64_t in, int64_t out, int kernel, int stride, int padding) {
  return std::make_unique<Conv2d>(Conv2dOptions{.in_channels = in,
                                                .out_channels = out,
                                                .kernel_size = kernel,
                                                .stride = stride,
                                                .padding = padding});
}

// d2l's resnet_block: `num_residuals` blocks; all but the first stage start by halving
// the resolution with a projected shortcut.
std::unique_ptr<Sequential> resnet_stage(int64_t in, int64_t out, int num_residuals,
                                         bool first_stage) {
  auto stage = std::make_unique<Sequential>();
  for (int i = 0; i < num_residuals; ++i) {
    if (i == 0 && !first_stage) {
      stage->append(std::make_unique<Residual>(in, out, /*use_1x1conv=*/true, /*stride=*/2));
    } else {
      stage->append(std::make_unique<Residual>(out, out));
    }
  }
  return stage;
}

std::unique_ptr<Module> resnet18(int64_t in_channels, int64_t num_classes) {
  auto stem = make_sequential(conv(in_channels, 64, 3, 1, 1), std::make_unique<BatchNorm2d>(64),
                              std::make_unique<ReLU>());
  return make_sequential(std::move(stem), resnet_stage(64, 64, 2, /*first_stage=*/true),
                         resnet_stage(64, 128, 2, false), resnet_stage(128, 256, 2, false),
                         resnet_stage(256, 512, 2, false), std::make_unique<AdaptiveAvgPool2d>(1),
                         std::make_unique<Flatten>(), std::make_unique<Linear>(512, num_classes));
}

std::unique_ptr<Module> lenet(int64_t in_channels, int64_t num_classes) {
  const Pool2dOptions pool{.kernel_size = 2, .stride = 2};
  // 28 -> conv5 pad 2 -> 28 -> pool -> 14 -> conv5 -> 10 -> pool -> 5.
  return make_sequential(
      conv(in_channels, 6, 5, 1, 2), std::make_unique<Sigmoid>(), std::make_unique<AvgPool2d>(pool),
      conv(6, 16, 5, 1, 0), std::make_unique<Sigmoid>(), std::make_unique<AvgPool2d>(pool),
      std::make_unique<Flatten>(), std::make_unique<Linear>(16 * 5 * 5, 120),
      std::make_unique<Sigmoid>(), std::make_unique<Linear>(120, 84), std::make_unique<Sigmoid>(),
      std::make_unique<Linear>(84, num_classes));
}

std::unique_ptr<Module> mlp(int64_t in_channels, int64_t num_classes) {
  return make_sequential(std::make_unique<Flatten>(),
                         std::make_unique<Linear>(in_channels * kImageSize * kImageSize, 256),
                         std::make_unique<ReLU>(), std::make_unique<Linear>(256, num_classes));
}

std::unique_ptr<Module> simplecnn(int64_t in_channels, int64_t num_classes) {
  return make_sequential(conv(in_channels, 64, 3, 1, 1), std::make_unique<ReLU>(),
                         conv(64, 128, 3, 1, 1), std::make_unique<ReLU>(),
                         std::make_unique<AdaptiveAvgPool2d>(1), std::make_unique<Flatten>(),
                         std::make_unique<Linear>(128, num_classes));
}

using ModelFactory = std::function<std::unique_ptr<Module>(int64_t, int64_t)>;

struct ZooEntry {
  std::string name;
  ModelFactory factory;
  int64_t fixed_side;  // the only image height and width it takes; 0 for any
};

const std::vector<ZooEntry>& registry() {
  static const std::vector<ZooEntry> models = {
      {"resnet18", resnet18, 0},
      {"lenet", lenet, kImageSize},
      {"mlp", mlp, kImageSize},
      {"simplecnn", simplecnn, 0},
      {"resnet34", [](int64_t c, int64_t k) { return torchvision_resnet(34, c, k); }, 0},
      {"resnet50", [](int64_t c, int64_t k) { return torchvision_resnet(50, c, k); }, 0}};
  return models;
}

}  // namespace

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const ZooEntry& e : registry()) out.push_back(e.name);
    return out;
  }();
  return names;
}

std::unique_ptr<Module> build_model(const std::string& name, int in_channels, int num_classes,
                                    const InitOptions& init) {
  if (in_channels < 1 || num_classes < 1) {
    throw InvalidArgument(fmt::format(
        "model '{}': expected in_channels >= 1 and num_classes >= 1, found {} and {}", name,
        in_channels, num_classes));
  }
  for (const ZooEntry& e : registry()) {
    if (e.name != name) continue;
    std::unique_ptr<Module> model = e.factory(in_channels, num_classes);
    init_parameters(*model, init);
    return model;
  }
  throw InvalidArgument(fmt::format("unknown model '{}': expected one of {}", name,
                                    fmt::join(model_names(), ", ")));
}

bool is_onnx_file(const std::string& model) {
  constexpr std::string_view kSuffix = ".onnx";
  return model.size() > kSuffix.size() && model.ends_with(kSuffix);
}

std::unique_ptr<Module> build_model_for_images(const std::string& model, int64_t channels, int64_t height,
                                               int64_t width, int64_t num_classes, const InitOptions& init) {
  if (is_onnx_file(model)) {
    std::unique_ptr<Module> graph = onnx::load_graph_model(model, channels, height, width, num_classes);
    init_parameters(*graph, init);
    return graph;
  }
  MTRAIN_CHECK(init.scheme != InitScheme::kGraph, "model {} is no graph to keep the weights of", model);
  check_input_size(model, height, width);
  return build_model(model, static_cast<int>(channels), static_cast<int>(num_classes), init);
}

void check_input_size(const std::string& name, int64_t height, int64_t width) {
  for (const ZooEntry& e : registry()) {
    if (e.name != name || e.fixed_side == 0) continue;
    if (height != e.fixed_side || width != e.fixed_side) {
      std::vector<std::string> any;
      for (const ZooEntry& other : registry()) {
        if (other.fixed_side == 0) any.push_back(other.name);
      }
      throw InvalidArgument(fmt::format("model '{}' takes {}x{} images, the data has {}x{}; pick {}, which take any size",
                                        name, e.fixed_side, e.fixed_side, height, width, fmt::join(any, " or ")));
    }
  }
}

}  // namespace mtrain::models
