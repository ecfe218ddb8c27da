#include "models/onnx/graph_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "core/error.h"
#include "models/activation.h"
#include "models/batchnorm.h"
#include "models/channel_scale.h"
#include "models/conv.h"
#include "models/dropout.h"
#include "models/identity.h"
#include "models/flatten.h"
#include "models/layer_norm.h"
#include "models/linear.h"
#include "models/onnx/array_ops.h"
#include "models/onnx/onnx_graph.h"
#include "models/pooling.h"
#include "models/sequential.h"
#include "tensor/ops.h"

namespace mtrain::models::onnx {

// Note [Graph models keep PyTorch's names]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch.onnx.export in training mode without constant folding keeps each parameter and
// buffer as an initializer under its state_dict name ("layer1.0.conv1.weight"). A layer
// that has weights becomes a child named after its weight's module ("layer1.0.conv1"), so
// its parameters are named "layer1.0.conv1.weight" and "...bias" again (Note [Parameter
// names] in module.cpp), and each starts from the initializer of its own name: checkpoints,
// --save-final and --init-from then speak PyTorch's names, and the file mtrain writes loads
// into the exported module with load_state_dict. An initializer that is not named so (an
// eval-mode export folds batch norms into the convolutions and names what it computed
// "onnx::Conv_123") has no module to go back to, so it is refused with the export to use.
// Layers without weights are named after their op and node ("Relu_5"): no state_dict holds
// them. num_batches_tracked, which the export drops, starts at 0.

namespace {

constexpr const char* kExportHint =
    "export the module in training mode: torch.onnx.export(model, x, FILE, "
    "training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)";

std::string prefix(const Graph& g) { return fmt::format("--model {}", g.path); }

int64_t int_attribute(const Graph& g, const Node& n, const std::string& name, int64_t fallback) {
  const auto it = n.attributes.find(name);
  if (it == n.attributes.end()) return fallback;
  if (it->second.kind != Attribute::Kind::kInt) {
    throw InvalidArgument(fmt::format("{}: {}: attribute {} is not an integer", prefix(g), n.describe(), name));
  }
  return it->second.i;
}

float float_attribute(const Graph& g, const Node& n, const std::string& name, float fallback) {
  const auto it = n.attributes.find(name);
  if (it == n.attributes.end()) return fallback;
  if (it->second.kind != Attribute::Kind::kFloat) {
    throw InvalidArgument(fmt::format("{}: {}: attribute {} is not a number", prefix(g), n.describe(), name));
  }
  return it->second.f;
}

std::vector<int64_t> ints_attribute(const Graph& g, const Node& n, const std::string& name,
                                    std::vector<int64_t> fallback) {
  const auto it = n.attributes.find(name);
  if (it == n.attributes.end()) return fallback;
  if (it->second.kind != Attribute::Kind::kInts) {
    throw InvalidArgument(fmt::format("{}: {}: attribute {} is not a list of integers", prefix(g), n.describe(), name));
  }
  return it->second.ints;
}

std::string string_attribute(const Graph& g, const Node& n, const std::string& name, const std::string& fallback) {
  const auto it = n.attributes.find(name);
  if (it == n.attributes.end()) return fallback;
  if (it->second.kind != Attribute::Kind::kString) {
    throw InvalidArgument(fmt::format("{}: {}: attribute {} is not a string", prefix(g), n.describe(), name));
  }
  return it->second.s;
}

// The one value of a window's per-axis sizes (kernel, strides, pads): mtrain's layers take
// square windows and the same padding on every side.
int one_size(const Graph& g, const Node& n, const std::string& what, const std::vector<int64_t>& values) {
  if (values.empty() || values.size() % 2 != 0) {
    throw InvalidArgument(fmt::format("{}: {}: {} has {} values; mtrain's layers work on 2-D images", prefix(g),
                                      n.describe(), what, values.size()));
  }
  for (int64_t v : values) {
    if (v < 0 || v > std::numeric_limits<int>::max()) {
      throw InvalidArgument(fmt::format("{}: {}: {} [{}] is out of range", prefix(g), n.describe(), what,
                                        fmt::join(values, ", ")));
    }
    if (v != values.front()) {
      throw InvalidArgument(fmt::format("{}: {}: {} [{}]; mtrain's layers take one value for every axis and side "
                                        "(square windows, symmetric padding)",
                                        prefix(g), n.describe(), what, fmt::join(values, ", ")));
    }
  }
  return static_cast<int>(values.front());
}

// The height's and the width's value of a convolution's kernel_shape or strides ([h, w]) or
// pads ([top, left, bottom, right]: the same at both ends of an axis).
std::pair<int, int> per_axis(const Graph& g, const Node& n, const std::string& what, const std::vector<int64_t>& values) {
  const bool pads = values.size() == 4;
  const bool fits = (values.size() == 2 || (pads && values[0] == values[2] && values[1] == values[3])) &&
                    std::all_of(values.begin(), values.end(),
                                [](int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); });
  if (!fits) {
    throw InvalidArgument(fmt::format("{}: {}: {} [{}]; mtrain's convolutions work on 2-D images and pad both ends "
                                      "of an axis alike",
                                      prefix(g), n.describe(), what, fmt::join(values, ", ")));
  }
  return {static_cast<int>(values[0]), static_cast<int>(values[1])};
}

void require(const Graph& g, const Node& n, bool ok, const std::string& what) {
  if (!ok) {
    throw InvalidArgument(fmt::format("{}: {}: {}, which mtrain's layers do not offer", prefix(g), n.describe(), what));
  }
}

// Input `i` of `n`, which must be an initializer (a weight), or nullptr when left out.
const Tensor* weight_input(const Graph& g, const Node& n, size_t i) {
  if (i >= n.inputs.size() || n.inputs[i].empty()) return nullptr;
  const auto it = g.initializers.find(n.inputs[i]);
  if (it == g.initializers.end()) {
    throw InvalidArgument(fmt::format("{}: {}: its input {} ('{}') is computed in the graph; mtrain trains weights "
                                      "that are initializers",
                                      prefix(g), n.describe(), i, n.inputs[i]));
  }
  return &it->second;
}

// Note [Graph models keep PyTorch's names]: "conv1.weight" -> "conv1", for the weight that
// input 1 of `n` names, or `weight`.
std::string module_name(const Graph& g, const Node& n, const std::string& weight_name = {}) {
  const std::string& weight = weight_name.empty() ? n.inputs.at(1) : weight_name;
  if (weight.starts_with("onnx::")) {
    throw InvalidArgument(fmt::format("{}: {}: its weight '{}' was computed by the export (an eval-mode export folds "
                                      "each batch norm into the convolution before it), so it is no module's "
                                      "parameter to train; {}",
                                      prefix(g), n.describe(), weight, kExportHint));
  }
  if (!weight.ends_with(".weight")) {
    throw InvalidArgument(fmt::format("{}: {}: its weight '{}' is not named as a PyTorch parameter (MODULE.weight); {}",
                                      prefix(g), n.describe(), weight, kExportHint));
  }
  return weight.substr(0, weight.size() - std::string(".weight").size());
}

// auto_pad computes padding from the input's size; mtrain's layers take it explicitly (VALID
// is none at all).
void require_explicit_padding(const Graph& g, const Node& n) {
  const std::string mode = string_attribute(g, n, "auto_pad", "NOTSET");
  require(g, n, mode == "NOTSET" || mode == "VALID", fmt::format("auto_pad {} (padding from the input's size)", mode));
}

struct Layer {
  std::unique_ptr<Module> module;
  std::string name;  // the child's name; empty: OP_INDEX
};

Layer conv(const Graph& g, const Node& n) {
  const Tensor* w = weight_input(g, n, 1);
  require(g, n, w != nullptr && w->ndim() == 4, "a weight that is no 4-D initializer");
  require_explicit_padding(g, n);
  Conv2dOptions o;
  std::tie(o.dilation, o.dilation_w) = per_axis(g, n, "dilations", ints_attribute(g, n, "dilations", {1, 1}));
  const int64_t groups = int_attribute(g, n, "group", 1);
  require(g, n, groups >= 1 && groups <= w->shape()[0] && w->shape()[0] % groups == 0, fmt::format("group {}", groups));
  o.groups = static_cast<int>(groups);
  o.out_channels = w->shape()[0];
  o.in_channels = w->shape()[1] * o.groups;
  std::tie(o.kernel_size, o.kernel_w) =
      per_axis(g, n, "kernel_shape", ints_attribute(g, n, "kernel_shape", {w->shape()[2], w->shape()[3]}));
  std::tie(o.stride, o.stride_w) = per_axis(g, n, "strides", ints_attribute(g, n, "strides", {1, 1}));
  std::tie(o.padding, o.padding_w) = per_axis(g, n, "pads", ints_attribute(g, n, "pads", {0, 0, 0, 0}));
  o.bias = weight_input(g, n, 2) != nullptr;
  return {std::make_unique<Conv2d>(o), module_name(g, n)};
}

// ONNX's momentum weighs the running statistic (0.9), PyTorch's the batch's (0.1); the
// float32 attribute is rounded back to the 6 decimals a PyTorch momentum is written with.
Layer batch_norm(const Graph& g, const Node& n) {
  // Training mode: opset 14 says so in an attribute; before it, by the running statistics
  // among the outputs.
  const bool training = g.opset >= 14 ? int_attribute(g, n, "training_mode", 0) == 1 : n.outputs.size() > 1;
  if (!training) {
    throw InvalidArgument(fmt::format("{}: {}: the batch norm was exported in eval mode (it would normalise with its "
                                      "running statistics only); {}",
                                      prefix(g), n.describe(), kExportHint));
  }
  const Tensor* scale = weight_input(g, n, 1);
  require(g, n, scale != nullptr && scale->ndim() == 1, "a scale that is no 1-D initializer");
  for (size_t i = 2; i < 5; ++i) weight_input(g, n, i);
  const double momentum = std::round((1.0 - float_attribute(g, n, "momentum", 0.9f)) * 1e6) / 1e6;
  return {std::make_unique<BatchNorm2d>(scale->shape()[0], written_decimal(float_attribute(g, n, "epsilon", 1e-5f)),
                                        momentum),
          module_name(g, n)};
}

Layer gemm(const Graph& g, const Node& n) {
  const Tensor* w = weight_input(g, n, 1);
  require(g, n, w != nullptr && w->ndim() == 2, "a weight that is no 2-D initializer");
  require(g, n, int_attribute(g, n, "transA", 0) == 0 && int_attribute(g, n, "transB", 0) == 1,
          "transA or no transB (a torch.nn.Linear exports transB=1)");
  require(g, n, float_attribute(g, n, "alpha", 1) == 1 && float_attribute(g, n, "beta", 1) == 1, "alpha or beta other than 1");
  return {std::make_unique<Linear>(w->shape()[1], w->shape()[0], weight_input(g, n, 2) != nullptr), module_name(g, n)};
}

Pool2dOptions window(const Graph& g, const Node& n) {
  require_explicit_padding(g, n);
  const std::vector<int64_t> dilations = ints_attribute(g, n, "dilations", {1, 1});
  require(g, n, one_size(g, n, "dilations", dilations) == 1, fmt::format("dilations [{}]", fmt::join(dilations, ", ")));
  Pool2dOptions o;
  o.kernel_size = one_size(g, n, "kernel_shape", ints_attribute(g, n, "kernel_shape", {}));
  o.stride = one_size(g, n, "strides", ints_attribute(g, n, "strides", {1, 1}));
  o.padding = one_size(g, n, "pads", ints_attribute(g, n, "pads", {0, 0, 0, 0}));
  o.ceil_mode = int_attribute(g, n, "ceil_mode", 0) != 0;
  return o;
}

Layer max_pool(const Graph& g, const Node& n) {
  require(g, n, n.outputs.size() == 1 && int_attribute(g, n, "storage_order", 0) == 0, "indices as an output");
  return {std::make_unique<MaxPool2d>(window(g, n)), ""};
}

Layer average_pool(const Graph& g, const Node& n) {
  const Pool2dOptions o = window(g, n);
  require(g, n, !o.ceil_mode, "ceil_mode 1 in an average pooling");
  // mtrain's AvgPool2d divides by the whole window, padding included (PyTorch's default).
  require(g, n, o.padding == 0 || int_attribute(g, n, "count_include_pad", 0) == 1,
          "padding left out of the average (count_include_pad=False)");
  return {std::make_unique<AvgPool2d>(o), ""};
}

Layer flatten(const Graph& g, const Node& n) {
  require(g, n, int_attribute(g, n, "axis", 1) == 1, fmt::format("axis {}", int_attribute(g, n, "axis", 1)));
  return {std::make_unique<Flatten>(), ""};
}

// x.mean([2, 3]) of images [N, C, H, W]: global average pooling, flattened to [N, C] unless
// keepdims (ShuffleNet and MNASNet end so).
Layer reduce_mean(const Graph& g, const Node& n) {
  std::vector<int64_t> axes = ints_attribute(g, n, "axes", {});
  for (int64_t& a : axes) a = a < 0 ? a + 4 : a;  // the images' rank; the layer checks it
  std::sort(axes.begin(), axes.end());
  require(g, n, axes == std::vector<int64_t>{2, 3},
          fmt::format("a mean over axes [{}] (mtrain averages images over their height and width, axes [2, 3]; a "
                      "LayerNorm exports as such means before opset 17: export with opset_version=17)",
                      fmt::join(ints_attribute(g, n, "axes", {}), ", ")));
  if (int_attribute(g, n, "keepdims", 1) != 0) return {std::make_unique<AdaptiveAvgPool2d>(1), ""};
  return {make_sequential(std::make_unique<AdaptiveAvgPool2d>(1), std::make_unique<Flatten>()), ""};
}

// Input `i` of `n` as one number (an initializer, or a Constant node's value), `fallback`
// when it is left out.
float scalar_input(const Graph& g, const Node& n, size_t i, float fallback) {
  const Tensor* t = weight_input(g, n, i);
  if (t == nullptr) return fallback;
  require(g, n, t->numel() == 1, fmt::format("input {} with {} values where one bound goes", i, t->numel()));
  return t->data<float>()[0];
}

// torch.clamp and ReLU6: min and max are inputs from opset 11, attributes before it.
Layer clip(const Graph& g, const Node& n) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float lo = g.opset >= 11 ? scalar_input(g, n, 1, -kInf) : float_attribute(g, n, "min", -kInf);
  const float hi = g.opset >= 11 ? scalar_input(g, n, 2, kInf) : float_attribute(g, n, "max", kInf);
  if (lo == 0.0f && hi == kInf) return {std::make_unique<ReLU>(), ""};
  require(g, n, std::isfinite(lo) && std::isfinite(hi) && lo < hi,
          fmt::format("bounds [{}, {}] (mtrain clips to two finite bounds, or to [0, inf) as ReLU)", lo, hi));
  return {std::make_unique<Hardtanh>(lo, hi), ""};
}

// torch.nn.Hardsigmoid exports alpha 1/6 and beta 0.5 (ONNX's defaults are Keras's 0.2, 0.5).
Layer hard_sigmoid(const Graph& g, const Node& n) {
  const float alpha = float_attribute(g, n, "alpha", 0.2f), beta = float_attribute(g, n, "beta", 0.5f);
  require(g, n, alpha == 1.0f / 6.0f && beta == 0.5f,
          fmt::format("alpha {} and beta {} (mtrain's Hardsigmoid is PyTorch's: alpha 1/6, beta 0.5)", alpha, beta));
  return {std::make_unique<Hardsigmoid>(), ""};
}

// Note [Padding folds into the next layer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// F.avg_pool2d(x, 3, 1, padding=1) exports as a Pad of zeros and an AveragePool without
// padding (Inception does so); a ZeroPad2d before a convolution does the same. A window over
// zeros that a Pad added is the window of a layer that pads with zeros itself and counts
// them (count_include_pad), so the Pad becomes no step: the node that reads it reads the
// Pad's input with the padding added to its own. Only a Conv or AveragePool without padding
// of its own may read a Pad's output (a MaxPool pads with -inf, not zeros).

// The zeros a Pad node adds on each side of the height and width (the same on all four;
// none on the batch or the channels).
int zero_padding(const Graph& g, const Node& n) {
  require(g, n, string_attribute(g, n, "mode", "constant") == "constant",
          fmt::format("mode {} padding", string_attribute(g, n, "mode", "constant")));
  std::vector<int64_t> pads;
  float value = 0;
  if (g.opset >= 11) {
    const Tensor* t = weight_input(g, n, 1);
    require(g, n, t != nullptr, "pads that are computed");
    for (int64_t i = 0; i < t->numel(); ++i) pads.push_back(static_cast<int64_t>(t->data<float>()[i]));
    value = scalar_input(g, n, 2, 0.0f);
  } else {
    pads = ints_attribute(g, n, "pads", {});
    value = float_attribute(g, n, "value", 0.0f);
  }
  require(g, n, value == 0.0f, fmt::format("padding with {} (mtrain pads with zeros)", value));
  const bool images = pads.size() == 8 && pads[0] == 0 && pads[1] == 0 && pads[4] == 0 && pads[5] == 0;
  require(g, n, images, fmt::format("pads [{}] (mtrain pads images [N, C, H, W] in their height and width)",
                                    fmt::join(pads, ", ")));
  return one_size(g, n, "pads", {pads[2], pads[3], pads[6], pads[7]});
}

// torch.nn.LayerNorm over the last dimension (opset 17 keeps it one node).
Layer layer_norm(const Graph& g, const Node& n) {
  const Tensor* w = weight_input(g, n, 1);
  require(g, n, w != nullptr && w->ndim() == 1 && weight_input(g, n, 2) != nullptr,
          "a scale or bias that is no 1-D initializer");
  require(g, n, int_attribute(g, n, "axis", -1) == -1,
          fmt::format("normalising from axis {} (mtrain normalises the last dimension)", int_attribute(g, n, "axis", -1)));
  require(g, n, n.outputs.size() == 1, "the mean or inverse deviation as outputs");
  return {std::make_unique<LayerNorm>(w->shape()[0], float_attribute(g, n, "epsilon", 1e-5f)), module_name(g, n)};
}

// torch.nn.Dropout: the rate and whether it trains are inputs from opset 12 (a training-mode
// export says true), the rate an attribute before it. Each node draws its own masks (its
// index seeds them).
Layer dropout(const Graph& g, const Node& n) {
  const bool trains = g.opset >= 12 ? scalar_input(g, n, 2, 0.0f) != 0.0f : true;
  const float p = g.opset >= 12 ? scalar_input(g, n, 1, 0.5f) : float_attribute(g, n, "ratio", 0.5f);
  require(g, n, p >= 0.0f && p < 1.0f, fmt::format("ratio {}", p));
  if (!trains) return {std::make_unique<Identity>(), ""};
  return {std::make_unique<Dropout>(p, 0x5EED0000ull + static_cast<uint64_t>(n.index)), ""};
}

using LayerFactory = std::function<Layer(const Graph&, const Node&)>;

// The operators that become a layer; Add and Identity are the graph's own (GraphModel::Step).
const std::map<std::string, LayerFactory>& layer_factories() {
  static const std::map<std::string, LayerFactory> factories = {
      {"Conv", conv},
      {"BatchNormalization", batch_norm},
      {"Gemm", gemm},
      {"Relu", [](const Graph&, const Node&) { return Layer{std::make_unique<ReLU>(), ""}; }},
      {"Sigmoid", [](const Graph&, const Node&) { return Layer{std::make_unique<Sigmoid>(), ""}; }},
      {"Clip", clip},
      {"HardSigmoid", hard_sigmoid},
      {"HardSwish", [](const Graph&, const Node&) { return Layer{std::make_unique<Hardswish>(), ""}; }},
      {"MaxPool", max_pool},
      {"AveragePool", average_pool},
      {"GlobalAveragePool", [](const Graph&, const Node&) { return Layer{std::make_unique<AdaptiveAvgPool2d>(1), ""}; }},
      {"Flatten", flatten},
      {"ReduceMean", reduce_mean},
      {"LayerNormalization", layer_norm},
      {"Erf", [](const Graph&, const Node&) { return Layer{std::make_unique<Erf>(), ""}; }},
      {"Dropout", dropout},
  };
  return factories;
}

// An undefined `into` takes `g` (sharing it: nobody writes a gradient in place), else the sum.
void accumulate(Tensor& into, const Tensor& g) {
  if (!g.defined()) return;
  if (!into.defined()) {
    into = g;
    return;
  }
  Tensor sum = Tensor::empty(into.shape(), into.dtype(), into.device());
  ops::add(into, g, sum);
  into = sum;
}

// The input of `n` that is an initializer or a constant, if one is (an arithmetic node's).
std::optional<size_t> constant_operand(const Graph& g, const Node& n) {
  for (size_t i = 0; i < n.inputs.size() && i < 2; ++i) {
    if (g.initializers.count(n.inputs[i])) return i;
  }
  return std::nullopt;
}

// The one node that reads `value`, or nullptr (none, several, or the graph's output).
const Node* sole_reader(const Graph& g, const std::string& value) {
  const Node* reader = nullptr;
  for (const Node& m : g.nodes) {
    if (std::find(m.inputs.begin(), m.inputs.end(), value) == m.inputs.end()) continue;
    if (reader != nullptr) return nullptr;
    reader = &m;
  }
  return value == g.output ? nullptr : reader;
}

}  // namespace

const std::vector<std::string>& supported_operators() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& [name, factory] : layer_factories()) out.push_back(name);
    // The graph's own steps and the nodes that become other layers or none.
    for (const char* op : {"Add", "Concat", "Div", "Identity", "MatMul", "Mul", "Pad", "Reshape", "Shape", "Slice",
                           "Sub", "Transpose"}) {
      out.push_back(op);
    }
    std::sort(out.begin(), out.end());
    return out;
  }();
  return names;
}

namespace {

// Note [Graph models keep PyTorch's names]: every parameter and buffer from the initializer
// of its name.
void set_initial_values(const Graph& g, Module& model) {
  const auto value_for = [&](const std::string& name, const Shape& shape) -> const Tensor* {
    const auto it = g.initializers.find(name);
    if (it == g.initializers.end()) return nullptr;
    if (it->second.shape() != shape) {
      throw InvalidArgument(fmt::format("{}: initializer '{}' has shape [{}], but its layer needs [{}]", prefix(g),
                                        name, fmt::join(it->second.shape(), ", "), fmt::join(shape, ", ")));
    }
    return &it->second;
  };
  for (NamedParameter& p : model.parameters()) {
    const Tensor* value = value_for(p.name, p.param->value.shape());
    if (value == nullptr) {
      throw InvalidArgument(fmt::format("{}: the graph has no initializer '{}' for its layer's parameter; {}",
                                        prefix(g), p.name, kExportHint));
    }
    p.param->value.copy_(*value);
  }
  for (NamedBuffer& b : model.buffers()) {
    if (const Tensor* value = value_for(b.name, b.buffer->shape())) {
      b.buffer->copy_(*value);
    } else if (b.name.ends_with(".num_batches_tracked")) {
      b.buffer->zero_();  // the export drops it
    } else {
      throw InvalidArgument(fmt::format("{}: the graph has no initializer '{}' for its layer's buffer; {}", prefix(g),
                                        b.name, kExportHint));
    }
  }
}

}  // namespace

// The graph's values by name while the nodes are added: each gets an id in the forward's
// table as the node that computes it is added.
struct GraphModel::Wiring {
  const Graph& g;
  int& count;                         // GraphModel::num_values_
  std::vector<std::pair<int, Array>>& constant_arrays;  // GraphModel::constant_arrays_
  std::map<std::string, int> ids;     // a value's id (an Identity's output shares its input's)
  std::map<std::string, std::string> unread;  // outputs no node may read (a batch norm's running statistics, a dropout's mask), by their node
  std::set<std::string> modules;      // child names taken
  struct Padding {
    const Node* pad;
    int size;
  };
  std::map<std::string, Padding> padded;  // Pad outputs (Note [Padding folds into the next layer])
  std::set<int> arrays;               // ids of values that are arrays (Note [Shapes computed with the images])
  std::map<std::string, std::string> transposed;  // Transposes of a weight (MatMul's operand): the weight's name
  std::set<int> fused;                // nodes an earlier node's layer computes (a MatMul's bias Add)

  int fresh(const std::string& name) { return ids[name] = count++; }

  bool is_array(const std::string& name) const {
    const auto it = ids.find(name);
    return (it != ids.end() && arrays.count(it->second)) || (it == ids.end() && g.constants.count(name));
  }

  // The id of input `i` of `n`, an image (a tensor) that an earlier node computes.
  int of(const Node& n, size_t i) const {
    const std::string& name = n.inputs.at(i);
    if (const auto it = ids.find(name); it != ids.end()) {
      if (arrays.count(it->second)) {
        throw InvalidArgument(fmt::format("{}: {}: its input {} ('{}') is a shape or other numbers, where mtrain "
                                          "expects an activation",
                                          prefix(g), n.describe(), i, name));
      }
      return it->second;
    }
    if (g.initializers.count(name)) {
      throw InvalidArgument(fmt::format("{}: {}: its input {} ('{}') is a constant; mtrain's graphs compute there",
                                        prefix(g), n.describe(), i, name));
    }
    if (transposed.count(name)) {
      throw InvalidArgument(fmt::format("{}: {}: it reads the transposed weight '{}', which mtrain reads as a "
                                        "MatMul's second operand only (torch.nn.Linear's export)",
                                        prefix(g), n.describe(), name));
    }
    if (const auto it = padded.find(name); it != padded.end()) {
      throw InvalidArgument(fmt::format("{}: {}: it reads the padding of {}, which mtrain adds inside a convolution or "
                                        "an average pooling that reads it (without padding of its own) only",
                                        prefix(g), n.describe(), it->second.pad->describe()));
    }
    if (const auto it = unread.find(name); it != unread.end()) {
      throw InvalidArgument(fmt::format("{}: {}: it reads an output of {} that mtrain does not compute (running "
                                        "statistics, a dropout mask)",
                                        prefix(g), n.describe(), it->second));
    }
    throw InvalidArgument(fmt::format("{}: {}: its input '{}' is computed by no node before it", prefix(g),
                                      n.describe(), name));
  }

  // The id of input `i` of `n` as an array (a shape computed with the images, or a
  // constant); -1 when left out.
  int array_of(const Node& n, size_t i) {
    if (i >= n.inputs.size() || n.inputs[i].empty()) return -1;
    const std::string& name = n.inputs[i];
    if (const auto it = ids.find(name); it != ids.end()) {
      if (!arrays.count(it->second)) {
        throw InvalidArgument(fmt::format("{}: {}: its input {} ('{}') is an activation, where mtrain expects a "
                                          "shape or other numbers",
                                          prefix(g), n.describe(), i, name));
      }
      return it->second;
    }
    if (const auto it = g.constants.find(name); it != g.constants.end()) {
      const int id = fresh(name);
      arrays.insert(id);
      constant_arrays.emplace_back(id, it->second);
      return id;
    }
    return of(n, i);  // says why there is no such value
  }

  // `n`, or a Conv or AveragePool that reads a Pad's output as reading the Pad's input with
  // that padding of its own (Note [Padding folds into the next layer]).
  Node with_padding_folded(const Node& n) const {
    const auto it = n.inputs.empty() ? padded.end() : padded.find(n.inputs[0]);
    if (it == padded.end()) return n;
    const std::vector<int64_t> own = ints_attribute(g, n, "pads", {0, 0, 0, 0});
    const bool folds = (n.op_type == "Conv" || n.op_type == "AveragePool") &&
                       std::all_of(own.begin(), own.end(), [](int64_t p) { return p == 0; }) &&
                       string_attribute(g, n, "auto_pad", "NOTSET") == "NOTSET";
    if (!folds) return n;  // of() names the Pad
    Node folded = n;
    folded.inputs[0] = it->second.pad->inputs.at(0);
    const int64_t p = it->second.size;
    Attribute& pads = folded.attributes["pads"];
    pads.kind = Attribute::Kind::kInts;
    pads.ints = {p, p, p, p};
    Attribute& counted = folded.attributes["count_include_pad"];
    counted.kind = Attribute::Kind::kInt;
    counted.i = 1;
    return folded;
  }

  // Whether `n` (`node` with padding folded) becomes no step: an alias (Identity, a Pad of
  // nothing), padding for the node that reads it (Pad), a weight's Transpose (a MatMul's
  // operand), or an Add that an earlier node's layer computes.
  bool absorbs(const Node& node, const Node& n) {
    if (fused.count(n.index)) return true;
    if (n.op_type == "Pad") {
      if (const int padding = zero_padding(g, n); padding > 0) {
        padded[n.outputs.at(0)] = {&node, padding};
        return true;
      }
    }
    if (n.op_type == "Identity" || n.op_type == "Pad") {
      ids[n.outputs.at(0)] = of(n, 0);
      return true;
    }
    const bool of_weight = !n.inputs.empty() && g.initializers.count(n.inputs[0]) && !g.constants.count(n.inputs[0]);
    if (n.op_type != "Transpose" || !of_weight) return false;
    const std::vector<int64_t> perm = ints_attribute(g, n, "perm", {1, 0});
    require(g, n, g.initializers.at(n.inputs[0]).ndim() == 2 && perm == std::vector<int64_t>{1, 0},
            "a transpose of a weight other than a matrix's (torch.nn.Linear's export)");
    transposed[n.outputs.at(0)] = n.inputs[0];
    return true;
  }
};

// A layer for `n`: which of its inputs it reads and which value it computes (a MatMul's
// layer computes the bias Add after it too).
struct GraphModel::MadeLayer {
  Layer layer;
  size_t input = 0;
  std::string output;
};

// Arithmetic with a constant operand: Add, Sub, Mul or Div by a number is an Affine layer;
// Mul by a parameter of one value per channel (ConvNeXt's layer_scale) a ChannelScale that
// trains it.
GraphModel::MadeLayer GraphModel::constant_operand_layer(const Wiring& wiring, const Node& n, size_t k) {
  const Graph& g = wiring.g;
  const std::string& name = n.inputs[k];
  const Tensor& c = g.initializers.at(name);
  const size_t x = 1 - k;
  if (c.numel() == 1) {
    const float v = c.data<float>()[0];
    require(g, n, !(n.op_type == "Div" && k == 0), "a division of a constant by an activation");
    const float scale = n.op_type == "Mul" ? v : n.op_type == "Div" ? 1.0f / v : n.op_type == "Sub" && k == 0 ? -1.0f : 1.0f;
    const float shift = n.op_type == "Add" ? v : n.op_type == "Sub" ? (k == 0 ? v : -v) : 0.0f;
    return {{std::make_unique<Affine>(scale, shift), ""}, x, n.outputs.at(0)};
  }
  const size_t dot = name.rfind('.');
  const bool parameter = n.op_type == "Mul" && !g.constants.count(name) && !name.starts_with("onnx::") &&
                         dot != std::string::npos && dot > 0 && dot + 1 < name.size();
  require(g, n, parameter,
          fmt::format("{} by the constant '{}' of shape [{}] (mtrain takes a number, or a parameter of one value per "
                      "channel as a multiplier)",
                      n.op_type, name, fmt::join(c.shape(), ", ")));
  return {{std::make_unique<ChannelScale>(name.substr(dot + 1), c.shape()), name.substr(0, dot)}, x, n.outputs.at(0)};
}

// torch.nn.Linear applied to [..., in] exports MatMul(x, Transpose(weight)), then an Add of
// the bias when that Add is the MatMul's only reader: one Linear layer computes both.
GraphModel::MadeLayer GraphModel::matmul_layer(Wiring& wiring, const Node& n) {
  const Graph& g = wiring.g;
  const auto t = wiring.transposed.find(n.inputs.at(1));
  require(g, n, t != wiring.transposed.end(),
          "a second operand other than a transposed weight (torch.nn.Linear exports MatMul(x, Transpose(weight)))");
  const Tensor& w = g.initializers.at(t->second);
  const std::string module = module_name(g, n, t->second);
  const Node* add = sole_reader(g, n.outputs.at(0));
  const auto is_bias = [&](const std::string& name) {
    const auto it = g.initializers.find(name);
    return name == module + ".bias" && it != g.initializers.end() && it->second.shape() == Shape{w.shape()[0]};
  };
  const bool bias = add != nullptr && add->op_type == "Add" && add->inputs.size() == 2 &&
                    (is_bias(add->inputs[0]) || is_bias(add->inputs[1]));
  if (bias) wiring.fused.insert(add->index);
  return {{std::make_unique<Linear>(w.shape()[1], w.shape()[0], bias), module}, 0,
          bias ? add->outputs.at(0) : n.outputs.at(0)};
}

GraphModel::MadeLayer GraphModel::make_layer(Wiring& wiring, const Node& n) {
  const Graph& g = wiring.g;
  if (n.op_type == "Constant") {
    throw InvalidArgument(fmt::format("{}: {}: a constant that is not numbers; mtrain reads float, double, integer "
                                      "and bool constants",
                                      prefix(g), n.describe()));
  }
  if (n.op_type == "MatMul") return matmul_layer(wiring, n);
  const bool arithmetic = n.op_type == "Add" || n.op_type == "Sub" || n.op_type == "Mul" || n.op_type == "Div";
  if (const auto k = constant_operand(g, n); arithmetic && k) return constant_operand_layer(wiring, n, *k);
  const auto factory = layer_factories().find(n.op_type);
  if (factory == layer_factories().end()) {
    throw InvalidArgument(fmt::format("{}: {}: operator {} is not supported; mtrain trains graphs of {}", prefix(g),
                                      n.describe(), n.op_type, fmt::join(supported_operators(), ", ")));
  }
  return {factory->second(g, n), 0, n.outputs.at(0)};
}

GraphModel::GraphModel(const Graph& g) {
  Wiring wiring{g, num_values_, constant_arrays_, {}, {}, {}, {}, {}, {}, {}};
  input_ = wiring.fresh(g.input);
  for (const Node& n : g.nodes) add_node(n, wiring);
  const auto out = wiring.ids.find(g.output);
  if (out == wiring.ids.end()) {
    throw InvalidArgument(fmt::format("{}: the graph's output '{}' is computed by no node", prefix(g), g.output));
  }
  output_ = out->second;
  require_every_step_reaches_output(g);
  if (g.input_shape.size() != 4) {
    throw InvalidArgument(fmt::format("{}: the graph's input '{}' has {} dimensions; mtrain feeds images [N, C, H, W]",
                                      prefix(g), g.input, g.input_shape.size()));
  }
  image_shape_.assign(g.input_shape.begin() + 1, g.input_shape.end());
  export_batch_ = g.input_shape[0];
  path_ = g.path;
  set_initial_values(g, *this);
}

// One node: no step at all (Wiring::absorbs), a computation on arrays, a reshape, transpose
// or slice, a step of the graph's own (Add, Mul, Concat), or a layer as a child.
void GraphModel::add_node(const Node& node, Wiring& wiring) {
  const Node n = wiring.with_padding_folded(node);
  if (wiring.absorbs(node, n)) return;
  // Numbers only: an arithmetic node with an activation among its inputs is the images'.
  const bool on_arrays = n.op_type != "Shape" && evaluates(n.op_type) && !n.inputs.empty() &&
                         std::all_of(n.inputs.begin(), n.inputs.end(),
                                     [&](const std::string& in) { return in.empty() || wiring.is_array(in); });
  const bool graph_op = n.op_type == "Concat" || ((n.op_type == "Add" || n.op_type == "Mul") &&
                                                  !constant_operand(wiring.g, n));
  Step s = n.op_type == "Shape" || on_arrays                                               ? array_step(n, wiring)
           : n.op_type == "Reshape" || n.op_type == "Transpose" || n.op_type == "Slice" ? layout_step(n, wiring)
           : graph_op                                                                     ? graph_step(n, wiring)
                                                                                          : layer_step(n, wiring);
  s.node = n.describe();
  steps_.push_back(std::move(s));
}

// A Shape of an activation, or an operator on arrays (Note [Shapes computed with the images]).
GraphModel::Step GraphModel::array_step(const Node& n, Wiring& wiring) {
  Step s;
  s.kind = n.op_type == "Shape" ? Step::Kind::kShape : Step::Kind::kArray;
  if (s.kind == Step::Kind::kArray) {
    s.op = std::make_shared<const Node>(n);
    for (size_t i = 0; i < n.inputs.size(); ++i) s.inputs.push_back(wiring.array_of(n, i));
  } else {
    s.inputs = {wiring.of(n, 0)};
  }
  s.output = wiring.fresh(n.outputs.at(0));
  wiring.arrays.insert(s.output);
  return s;
}

// A Reshape, Transpose or Slice of an activation, its numbers from arrays.
GraphModel::Step GraphModel::layout_step(const Node& n, Wiring& wiring) {
  const Graph& g = wiring.g;
  require(g, n, n.op_type != "Slice" || g.opset >= 10, "a Slice of opset 9 (its bounds in attributes)");
  Step s;
  s.kind = n.op_type == "Reshape"     ? Step::Kind::kReshape
           : n.op_type == "Transpose" ? Step::Kind::kTranspose
                                      : Step::Kind::kSlice;
  s.inputs = {wiring.of(n, 0)};
  for (size_t i = 1; i < n.inputs.size(); ++i) s.inputs.push_back(wiring.array_of(n, i));
  s.perm = ints_attribute(g, n, "perm", {});
  s.output = wiring.fresh(n.outputs.at(0));
  return s;
}

// Add or Mul of two activations, or a Concat.
GraphModel::Step GraphModel::graph_step(const Node& n, Wiring& wiring) {
  Step s;
  s.kind = n.op_type == "Add" ? Step::Kind::kAdd : n.op_type == "Mul" ? Step::Kind::kMul : Step::Kind::kConcat;
  s.axis = int_attribute(wiring.g, n, "axis", 1);
  for (size_t i = 0; i < n.inputs.size(); ++i) s.inputs.push_back(wiring.of(n, i));
  s.output = wiring.fresh(n.outputs.at(0));
  return s;
}

// A layer (make_layer), registered as a child under its module's name or OP_INDEX.
GraphModel::Step GraphModel::layer_step(const Node& n, Wiring& wiring) {
  MadeLayer made = make_layer(wiring, n);
  const std::string name = made.layer.name.empty() ? fmt::format("{}_{}", n.op_type, n.index) : made.layer.name;
  if (!wiring.modules.insert(name).second) {
    throw InvalidArgument(fmt::format("{}: {}: module {}'s weights are used by a second node; mtrain trains each "
                                      "weight in one layer",
                                      prefix(wiring.g), n.describe(), name));
  }
  Step s;
  s.inputs = {wiring.of(n, made.input)};
  s.child = register_module(name, std::move(made.layer.module));
  for (size_t i = 1; i < n.outputs.size(); ++i) wiring.unread[n.outputs[i]] = n.describe();
  s.output = wiring.fresh(made.output);
  return s;
}

// A layer that does not reach the output would never see a gradient, and the reducer would
// wait for its parameters forever.
void GraphModel::require_every_step_reaches_output(const Graph& g) const {
  std::vector<bool> needed(static_cast<size_t>(num_values_), false);
  needed[static_cast<size_t>(output_)] = true;
  for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
    if (!needed[static_cast<size_t>(it->output)]) {
      throw InvalidArgument(fmt::format("{}: {} does not contribute to the graph's output; export the module "
                                        "without its unused branches",
                                        prefix(g), it->node));
    }
    for (int in : it->inputs) {
      if (in >= 0) needed[static_cast<size_t>(in)] = true;
    }
  }
}

namespace {

// The inputs of a concatenation side by side along the channels (dimension 1 of [N, C, ...]);
// `channels` learns each input's count for the backward.
Tensor concatenate(const GraphModel::Step& s, const std::vector<Tensor>& values, std::vector<int64_t>& channels) {
  const Tensor& first = values[static_cast<size_t>(s.inputs[0])];
  const int64_t axis = s.axis < 0 ? s.axis + first.ndim() : s.axis;
  if (axis != 1) {
    throw InvalidArgument(fmt::format("{}: concatenates along dimension {} of [{}]; mtrain concatenates along the "
                                      "channels (dimension 1)",
                                      s.node, s.axis, fmt::join(first.shape(), ", ")));
  }
  Shape shape = first.shape();
  shape[1] = 0;
  channels.clear();
  for (int in : s.inputs) {
    const Tensor& v = values[static_cast<size_t>(in)];
    Shape other = v.shape();
    if (other.size() == shape.size()) other[1] = 0;  // the channels may differ
    if (other != shape) {
      throw InvalidArgument(fmt::format("{}: concatenates [{}] and [{}], which differ beyond the channels", s.node,
                                        fmt::join(first.shape(), ", "), fmt::join(v.shape(), ", ")));
    }
    channels.push_back(v.shape()[1]);
  }
  for (int64_t c : channels) shape[1] += c;
  Tensor out = Tensor::empty(shape, first.dtype(), first.device());
  int64_t offset = 0;
  for (size_t i = 0; i < s.inputs.size(); ++i) {
    ops::copy_channels(values[static_cast<size_t>(s.inputs[i])], 0, out, offset, channels[i]);
    offset += channels[i];
  }
  return out;
}

// Whether `s` holds one value per (image, channel) of `x` [N, C, ...]: [N, C, 1, ...].
bool per_channel_of(const Tensor& s, const Tensor& x) {
  if (s.ndim() != x.ndim() || x.ndim() < 3 || s.shape()[0] != x.shape()[0] || s.shape()[1] != x.shape()[1]) return false;
  for (int d = 2; d < s.ndim(); ++d) {
    if (s.shape()[d] != 1) return false;
  }
  return true;
}

// a * b for two values of one shape, or [N, C, ...] scaled per image and channel (either
// side); the inputs are kept for the backward.
Tensor multiply(GraphModel::Step& s, const Tensor& a, const Tensor& b) {
  s.saved = {a, b};
  if (a.shape() == b.shape()) {
    Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
    ops::mul(a, b, out);
    return out;
  }
  const bool b_scales = per_channel_of(b, a);
  if (!b_scales && !per_channel_of(a, b)) {
    throw InvalidArgument(fmt::format("{}: multiplies [{}] and [{}]; mtrain multiplies values of one shape, or "
                                      "[N, C, ...] by [N, C, 1, 1]",
                                      s.node, fmt::join(a.shape(), ", "), fmt::join(b.shape(), ", ")));
  }
  const Tensor& x = b_scales ? a : b;
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  ops::scale_channels(x, b_scales ? b : a, out);
  return out;
}

// The gradients of multiply's inputs, in input order.
std::pair<Tensor, Tensor> multiply_backward(GraphModel::Step& s, const Tensor& dy) {
  const Tensor a = std::move(s.saved[0]), b = std::move(s.saved[1]);
  s.saved.clear();
  Tensor da = Tensor::empty(a.shape(), a.dtype(), a.device());
  Tensor db = Tensor::empty(b.shape(), b.dtype(), b.device());
  if (a.shape() == b.shape()) {
    ops::mul(dy, b, da);
    ops::mul(dy, a, db);
  } else if (per_channel_of(b, a)) {
    ops::scale_channels(dy, b, da);
    ops::channel_dot(dy, a, db);
  } else {
    ops::channel_dot(dy, b, da);
    ops::scale_channels(dy, a, db);
  }
  return {da, db};
}


// Note [Shapes computed with the images]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ShuffleNet splits its channels in two with x.chunk(2, dim=1), which exports as Slices
// whose bounds are computed from a Shape of the activation (Gather, Add, Div, Mul), and
// shuffles them with a Reshape to [N, groups, C / groups, H, W], a Transpose and a Reshape
// back. Those computations run with the images, on small host arrays (array_ops.h), each
// forward: a Shape step reads a value's shape, array steps compute from it, and Reshape,
// Transpose and Slice of activations take their numbers from them. They have no gradient.
// The batch dimension stays free: tracing writes the export's batch size into a Reshape's
// target shape, so its first dimension is always the batch (0, -1 or the export's batch
// size there mean the batch; anything else is refused).

// x viewed as `target` (ONNX's Reshape: 0 copies the dimension, -1 is inferred), its first
// dimension the batch.
Tensor reshape(const GraphModel::Step& s, const Tensor& x, const Array& target, int64_t export_batch) {
  std::vector<int64_t> dims;
  for (double v : target.values) dims.push_back(static_cast<int64_t>(v));
  const bool batch_first = !dims.empty() && (dims[0] == 0 || dims[0] == -1 || dims[0] == x.size(0) ||
                                             (export_batch > 0 && dims[0] == export_batch));
  if (!batch_first) {
    throw InvalidArgument(fmt::format("{}: reshapes [{}] to [{}]; mtrain keeps the batch as the first dimension",
                                      s.node, fmt::join(x.shape(), ", "), fmt::join(dims, ", ")));
  }
  dims[0] = x.size(0);
  int64_t known = 1, inferred = -1;
  for (size_t d = 1; d < dims.size(); ++d) {
    if (dims[d] == 0 && d < static_cast<size_t>(x.ndim())) dims[d] = x.size(static_cast<int>(d));
    if (dims[d] == -1 && inferred < 0) {
      inferred = static_cast<int64_t>(d);
    } else {
      known *= dims[d];
    }
  }
  if (inferred > 0 && known > 0) dims[static_cast<size_t>(inferred)] = x.numel() / (x.size(0) * known);
  const Shape shape(dims.begin(), dims.end());
  if (std::any_of(dims.begin(), dims.end(), [](int64_t d) { return d < 0; }) || shape_numel(shape) != x.numel()) {
    throw InvalidArgument(fmt::format("{}: reshapes [{}] to [{}], another number of elements", s.node,
                                      fmt::join(x.shape(), ", "), fmt::join(target.values, ", ")));
  }
  return x.view(shape);
}

// The channels [first, first + count) of x [N, C, ...]: a Slice along axis 1 with step 1.
Tensor slice_channels(GraphModel::Step& s, const Tensor& x, const std::vector<const Array*>& bounds) {
  const auto one = [&](size_t i, int64_t fallback) -> int64_t {
    if (i >= bounds.size() || bounds[i] == nullptr) return fallback;
    if (bounds[i]->values.size() != 1) {
      throw InvalidArgument(fmt::format("{}: slices several axes; mtrain slices the channels (axis 1) only", s.node));
    }
    return static_cast<int64_t>(bounds[i]->values[0]);
  };
  const int64_t axis = one(2, 0), step = one(3, 1);
  if ((axis != 1 && axis != 1 - x.ndim()) || step != 1) {
    throw InvalidArgument(fmt::format("{}: slices axis {} of [{}] in steps of {}; mtrain slices the channels (axis 1) "
                                      "in steps of 1 only",
                                      s.node, axis, fmt::join(x.shape(), ", "), step));
  }
  const int64_t channels = x.size(1);
  const auto clamp = [channels](int64_t v) { return std::clamp<int64_t>(v < 0 ? v + channels : v, 0, channels); };
  const int64_t first = clamp(one(0, 0)), end = std::max(first, clamp(one(1, channels)));
  Shape shape = x.shape();
  shape[1] = end - first;
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  ops::copy_channels(x, first, out, 0, end - first);
  s.input_shape = x.shape();
  s.first = first;
  return out;
}

std::vector<int64_t> transpose_perm(const GraphModel::Step& s, int ndim) {
  if (!s.perm.empty()) return s.perm;
  std::vector<int64_t> reversed;
  for (int d = ndim; d-- > 0;) reversed.push_back(d);
  return reversed;
}

Tensor transpose(const GraphModel::Step& s, const Tensor& x) {
  const std::vector<int64_t> perm = transpose_perm(s, x.ndim());
  Shape shape;
  for (int64_t p : perm) {
    if (perm.size() != static_cast<size_t>(x.ndim()) || x.ndim() > ops::kMaxPermuteDims || p < 0 || p >= x.ndim()) {
      throw InvalidArgument(fmt::format("{}: transposes [{}] by [{}]; mtrain transposes up to {} dimensions", s.node,
                                        fmt::join(x.shape(), ", "), fmt::join(perm, ", "), ops::kMaxPermuteDims));
    }
    shape.push_back(x.size(static_cast<int>(p)));
  }
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  ops::permute(x, perm, out);
  return out;
}

Tensor add(const GraphModel::Step& s, const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) {
    throw InvalidArgument(fmt::format("{}: adds [{}] and [{}]; mtrain adds values of one shape (no broadcasting)",
                                      s.node, fmt::join(a.shape(), ", "), fmt::join(b.shape(), ", ")));
  }
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  ops::add(a, b, out);
  return out;
}

Array shape_of(const Tensor& x) {
  Array out{{x.ndim()}, {}, true};
  for (int64_t d : x.shape()) out.values.push_back(static_cast<double>(d));
  return out;
}

}  // namespace

Tensor GraphModel::forward(const Tensor& x) {
  std::vector<Tensor> values(static_cast<size_t>(num_values_));
  std::vector<Array> arrays(static_cast<size_t>(num_values_));
  for (const auto& [id, value] : constant_arrays_) arrays[static_cast<size_t>(id)] = value;
  values[static_cast<size_t>(input_)] = x;
  const auto value = [&](int id) -> const Tensor& { return values[static_cast<size_t>(id)]; };
  // The arrays inputs from `from` on (nullptr where left out).
  const auto arrays_of = [&](const Step& s, size_t from) {
    std::vector<const Array*> out;
    for (size_t i = from; i < s.inputs.size(); ++i) out.push_back(s.inputs[i] < 0 ? nullptr : &arrays[static_cast<size_t>(s.inputs[i])]);
    return out;
  };
  for (Step& s : steps_) {
    Tensor& out = values[static_cast<size_t>(s.output)];
    switch (s.kind) {
      case Step::Kind::kLayer: out = child(s.child).forward(value(s.inputs[0])); break;
      case Step::Kind::kAdd: out = add(s, value(s.inputs[0]), value(s.inputs[1])); break;
      case Step::Kind::kConcat: out = concatenate(s, values, s.channels); break;
      case Step::Kind::kMul: out = multiply(s, value(s.inputs[0]), value(s.inputs[1])); break;
      case Step::Kind::kShape: arrays[static_cast<size_t>(s.output)] = shape_of(value(s.inputs[0])); break;
      case Step::Kind::kArray: arrays[static_cast<size_t>(s.output)] = evaluate(path_, *s.op, arrays_of(s, 0)); break;
      case Step::Kind::kReshape:
        s.input_shape = value(s.inputs[0]).shape();
        out = reshape(s, value(s.inputs[0]), *arrays_of(s, 1).at(0), export_batch_);
        break;
      case Step::Kind::kTranspose: out = transpose(s, value(s.inputs[0])); break;
      case Step::Kind::kSlice: out = slice_channels(s, value(s.inputs[0]), arrays_of(s, 1)); break;
    }
  }
  return values[static_cast<size_t>(output_)];
}

namespace {

// The gradient of a reshape, transpose or slice's input from its output's.
Tensor layout_backward(const GraphModel::Step& s, const Tensor& g) {
  if (s.kind == GraphModel::Step::Kind::kReshape) return g.view(s.input_shape);
  if (s.kind == GraphModel::Step::Kind::kSlice) {
    Tensor dx = Tensor::zeros(s.input_shape, g.dtype(), g.device());
    ops::copy_channels(g, 0, dx, s.first, g.size(1));
    return dx;
  }
  const std::vector<int64_t> perm = transpose_perm(s, g.ndim());
  std::vector<int64_t> inverse(perm.size());
  Shape shape(perm.size());
  for (size_t d = 0; d < perm.size(); ++d) {
    inverse[static_cast<size_t>(perm[d])] = static_cast<int64_t>(d);
    shape[static_cast<size_t>(perm[d])] = g.size(static_cast<int>(d));
  }
  Tensor dx = Tensor::empty(shape, g.dtype(), g.device());
  ops::permute(g, inverse, dx);
  return dx;
}

}  // namespace

Tensor GraphModel::backward(const Tensor& dy) {
  std::vector<Tensor> grads(static_cast<size_t>(num_values_));
  grads[static_cast<size_t>(output_)] = dy;
  for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
    if (it->kind == Step::Kind::kShape || it->kind == Step::Kind::kArray) continue;  // numbers, no gradient
    Tensor g = std::move(grads[static_cast<size_t>(it->output)]);
    MTRAIN_CHECK(g.defined(), "GraphModel: {} has no gradient in backward", it->node);
    Tensor& first = grads[static_cast<size_t>(it->inputs[0])];
    switch (it->kind) {
      case Step::Kind::kLayer: accumulate(first, child(it->child).backward(g)); break;
      case Step::Kind::kMul: {
        auto [da, db] = multiply_backward(*it, g);
        accumulate(first, da);
        accumulate(grads[static_cast<size_t>(it->inputs[1])], db);
        break;
      }
      case Step::Kind::kConcat: {
        int64_t offset = 0;
        for (size_t i = 0; i < it->inputs.size(); ++i) {
          Shape shape = g.shape();
          shape[1] = it->channels[i];
          Tensor part = Tensor::empty(shape, g.dtype(), g.device());
          ops::copy_channels(g, offset, part, 0, it->channels[i]);
          offset += it->channels[i];
          accumulate(grads[static_cast<size_t>(it->inputs[i])], part);
        }
        break;
      }
      case Step::Kind::kAdd:
        for (int in : it->inputs) accumulate(grads[static_cast<size_t>(in)], g);
        break;
      default: accumulate(first, layout_backward(*it, g)); break;
    }
  }
  return grads[static_cast<size_t>(input_)];
}

void GraphModel::set_input_grad_needed(bool needed) {
  Module::set_input_grad_needed(needed);
  for (const Step& s : steps_) {
    if (s.kind == Step::Kind::kLayer && s.inputs[0] == input_) child(s.child).set_input_grad_needed(needed);
  }
}

std::unique_ptr<GraphModel> load_graph_model(const std::string& path, int64_t channels, int64_t height,
                                             int64_t width, int64_t num_classes) {
  const Graph graph = read_graph(path);
  auto model = std::make_unique<GraphModel>(graph);
  const std::vector<int64_t> image{channels, height, width};
  for (size_t i = 0; i < 3; ++i) {
    if (model->image_shape()[i] > 0 && model->image_shape()[i] != image[i]) {
      throw InvalidArgument(fmt::format("--model {}: the graph takes images {} but the dataset's are {}x{}x{}; export "
                                        "it with an input of the dataset's shape (or use --resize)",
                                        path, fmt::join(model->image_shape(), "x"), channels, height, width));
    }
  }
  // One image through the graph in eval mode (the running statistics stay as they are)
  // finds layers that do not fit each other or the classes now, not at the first step.
  model->eval();
  Tensor logits;
  try {
    logits = model->forward(Tensor::zeros({1, channels, height, width}));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("--model {} on {}x{}x{} images: {}", path, channels, height, width, e.what()));
  }
  model->train();
  if (logits.shape() != Shape{1, num_classes}) {
    throw InvalidArgument(fmt::format("--model {}: the graph's output is [{}] for one image, but the dataset has {} "
                                      "classes: expected [1, {}]",
                                      path, fmt::join(logits.shape(), ", "), num_classes, num_classes));
  }
  return model;
}

}  // namespace mtrain::models::onnx
