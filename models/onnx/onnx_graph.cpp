#include "models/onnx/onnx_graph.h"

#include <fmt/format.h>
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

#include <charconv>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include "core/error.h"
#include "models/onnx/array_ops.h"

namespace mtrain::models::onnx {

namespace {

namespace pb = ::ONNX_NAMESPACE;

pb::ModelProto parse_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("--model {}: cannot open the file: {}", path, std::strerror(errno)));
  pb::ModelProto model;
  // A file of another kind rarely parses; when it does, it has no graph.
  if (!model.ParseFromIstream(&in) || !model.has_graph() || model.graph().node_size() == 0) {
    throw IoError(fmt::format("--model {}: not an ONNX model (expected an ONNX ModelProto with a graph, as "
                              "torch.onnx.export writes)",
                              path));
  }
  return model;
}

int64_t default_opset(const pb::ModelProto& model) {
  for (const auto& o : model.opset_import()) {
    if (o.domain().empty() || o.domain() == "ai.onnx") return o.version();
  }
  return 0;
}

// The shape of `t`, after checking that its data holds exactly that many elements of
// `element_bytes` each (raw data) or `listed` values: a damaged file must not make the reader
// allocate what its dimensions claim.
Shape checked_shape(const std::string& path, const pb::TensorProto& t, size_t element_bytes, size_t listed) {
  Shape shape;
  uint64_t count = 1;
  for (int64_t d : t.dims()) {
    if (d < 0 || (d > 0 && count > (uint64_t{1} << 40) / static_cast<uint64_t>(d))) {
      throw IoError(fmt::format("--model {}: tensor '{}' has dimensions [{}], which no file of this size holds", path,
                                t.name(), fmt::join(t.dims(), ", ")));
    }
    count *= static_cast<uint64_t>(d);
    shape.push_back(d);
  }
  const uint64_t held = t.has_raw_data() ? t.raw_data().size() : listed * element_bytes;
  if (held != count * element_bytes) {
    throw IoError(fmt::format("--model {}: tensor '{}' holds {} bytes, expected {} for its shape [{}]", path, t.name(),
                              held, count * element_bytes, fmt::join(shape, ", ")));
  }
  return shape;
}

Tensor read_initializer(const std::string& path, const pb::TensorProto& t) {
  if (t.data_location() == pb::TensorProto::EXTERNAL) {
    throw InvalidArgument(fmt::format("--model {}: initializer '{}' keeps its data in another file (ONNX external "
                                      "data); export the model in one file",
                                      path, t.name()));
  }
  if (t.data_type() != pb::TensorProto::FLOAT) {
    throw InvalidArgument(fmt::format("--model {}: initializer '{}' is {}, expected float32 (export the module "
                                      "in float32)",
                                      path, t.name(), pb::TensorProto_DataType_Name(t.data_type())));
  }
  Tensor out = Tensor::empty(checked_shape(path, t, sizeof(float), static_cast<size_t>(t.float_data_size())),
                             DType::Float32);
  if (t.has_raw_data()) {
    std::memcpy(out.data<float>(), t.raw_data().data(), t.raw_data().size());  // little-endian, as ONNX
  } else {
    std::copy(t.float_data().begin(), t.float_data().end(), out.data<float>());
  }
  return out;
}

// A tensor of numbers (a Constant's value, ConstantOfShape's fill): floating point, integer
// or bool; nullopt for any other type.
std::optional<Array> numbers(const std::string& path, const pb::TensorProto& t) {
  // Element i as a number, from the raw data's T or from the listed values.
  size_t bytes = 0, listed = 0;
  std::function<double(size_t)> value;
  const auto read = [&](auto type_tag, int count, auto listed_value) {
    using T = decltype(type_tag);
    bytes = sizeof(T);
    listed = static_cast<size_t>(count);
    if (!t.has_raw_data()) {
      value = [listed_value](size_t i) { return static_cast<double>(listed_value(static_cast<int>(i))); };
      return;
    }
    value = [&t](size_t i) {
      T v;
      std::memcpy(&v, t.raw_data().data() + i * sizeof(T), sizeof(T));
      return static_cast<double>(v);
    };
  };
  bool integer = true;
  switch (t.data_type()) {
    case pb::TensorProto::INT64:
      read(int64_t{}, t.int64_data_size(), [&t](int i) { return t.int64_data(i); });
      break;
    case pb::TensorProto::INT32:
      read(int32_t{}, t.int32_data_size(), [&t](int i) { return t.int32_data(i); });
      break;
    case pb::TensorProto::BOOL:  // one byte each in raw data, int32_data otherwise
      read(uint8_t{}, t.int32_data_size(), [&t](int i) { return t.int32_data(i) != 0 ? 1 : 0; });
      break;
    case pb::TensorProto::FLOAT:
      integer = false;
      read(float{}, t.float_data_size(), [&t](int i) { return t.float_data(i); });
      break;
    case pb::TensorProto::DOUBLE:
      integer = false;
      read(double{}, t.double_data_size(), [&t](int i) { return t.double_data(i); });
      break;
    default:
      return std::nullopt;
  }
  Array out;
  const Shape shape = checked_shape(path, t, bytes, listed);
  out.dims.assign(shape.begin(), shape.end());
  out.integer = integer;
  const size_t count = std::accumulate(shape.begin(), shape.end(), size_t{1}, std::multiplies<>());
  for (size_t i = 0; i < count; ++i) out.values.push_back(value(i));
  return out;
}

Attribute read_attribute(const std::string& path, const pb::AttributeProto& a) {
  Attribute out;
  switch (a.type()) {
    case pb::AttributeProto::INT:
      out.kind = Attribute::Kind::kInt;
      out.i = a.i();
      break;
    case pb::AttributeProto::INTS:
      out.kind = Attribute::Kind::kInts;
      out.ints.assign(a.ints().begin(), a.ints().end());
      break;
    case pb::AttributeProto::FLOAT:
      out.kind = Attribute::Kind::kFloat;
      out.f = a.f();
      break;
    case pb::AttributeProto::FLOATS:
      out.kind = Attribute::Kind::kFloats;
      out.floats.assign(a.floats().begin(), a.floats().end());
      break;
    case pb::AttributeProto::STRING:
      out.kind = Attribute::Kind::kString;
      out.s = a.s();
      break;
    case pb::AttributeProto::TENSOR:
      if (auto value = numbers(path, a.t())) {
        out.kind = Attribute::Kind::kTensor;
        out.tensor = std::move(*value);
      }
      break;
    default:
      break;  // graphs and lists of strings or tensors: no operator mtrain maps reads them
  }
  return out;
}

std::vector<int64_t> dims_of(const pb::ValueInfoProto& v) {
  std::vector<int64_t> dims;
  if (!v.type().has_tensor_type() || !v.type().tensor_type().has_shape()) return dims;
  for (const auto& d : v.type().tensor_type().shape().dim()) dims.push_back(d.has_dim_value() ? d.dim_value() : -1);
  return dims;
}

// A Constant node's value: its attribute "value" (a tensor) or one of the value_* forms.
std::optional<Array> constant_value(const Node& n) {
  if (n.op_type != "Constant" || n.attributes.size() != 1 || n.outputs.size() != 1) return std::nullopt;
  const auto& [name, a] = *n.attributes.begin();
  if (name == "value" && a.kind == Attribute::Kind::kTensor) return a.tensor;
  if (name == "value_float") return Array{{}, {a.f}, false};
  if (name == "value_int") return Array{{}, {static_cast<double>(a.i)}, true};
  if (name == "value_floats") return Array{{static_cast<int64_t>(a.floats.size())}, {a.floats.begin(), a.floats.end()}, false};
  if (name == "value_ints") return Array{{static_cast<int64_t>(a.ints.size())}, {a.ints.begin(), a.ints.end()}, true};
  return std::nullopt;
}

// Note [Folding the export's constants]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An export without constant folding (which keeps the parameters' names) computes what it
// knew while tracing in the graph: F.pad's paddings from a Shape of a constant, Gathers,
// Casts, ConstantOfShape, a Reshape and a Transpose of them; ReLU6's bounds as Casts of
// Constants. A node whose inputs are all constants is computed here, once (array_ops.h), and
// its output becomes a constant of the graph, as the Constants are: the model sees the
// Pad with its paddings, the Clip with its bounds.

// The graph's nodes as plain data into `g.nodes`, with what they compute from constants alone
// folded into `g.constants` and, as float32, `g.initializers`.
void read_nodes(const pb::GraphProto& graph, Graph& g) {
  std::map<std::string, Array> constants;
  for (int i = 0; i < graph.node_size(); ++i) {
    const pb::NodeProto& proto = graph.node(i);
    Node node;
    node.index = i;
    node.name = proto.name();
    node.op_type = proto.domain().empty() || proto.domain() == "ai.onnx" ? proto.op_type()
                                                                         : proto.domain() + "." + proto.op_type();
    node.inputs.assign(proto.input().begin(), proto.input().end());
    node.outputs.assign(proto.output().begin(), proto.output().end());
    for (const auto& a : proto.attribute()) node.attributes.emplace(a.name(), read_attribute(g.path, a));
    if (auto value = constant_value(node)) {
      constants.emplace(node.outputs[0], std::move(*value));
      continue;
    }
    std::vector<const Array*> inputs;
    bool all_constant = !node.inputs.empty() && evaluates(node.op_type);
    for (const std::string& input : node.inputs) {
      const auto it = constants.find(input);
      all_constant = all_constant && (input.empty() || it != constants.end());
      inputs.push_back(it == constants.end() ? nullptr : &it->second);
    }
    if (all_constant) {
      constants.emplace(node.outputs.at(0), evaluate(g.path, node, inputs));
      continue;
    }
    g.nodes.push_back(std::move(node));
  }
  for (const auto& [name, value] : constants) {
    Tensor t = Tensor::empty(Shape(value.dims.begin(), value.dims.end()), DType::Float32);
    std::copy(value.values.begin(), value.values.end(), t.data<float>());
    g.initializers.emplace(name, std::move(t));
  }
  g.constants = std::move(constants);
}

}  // namespace

std::string Node::describe() const {
  return name.empty() ? fmt::format("node {} ({})", index, op_type)
                      : fmt::format("node {} ({} '{}')", index, op_type, name);
}

std::string with_initializers(const std::string& source,
                              const std::vector<std::pair<std::string, Tensor>>& values) {
  pb::ModelProto model = parse_file(source);
  std::map<std::string, pb::TensorProto*> initializers;
  for (pb::TensorProto& t : *model.mutable_graph()->mutable_initializer()) initializers[t.name()] = &t;
  for (const auto& [name, value] : values) {
    const auto it = initializers.find(name);
    if (it == initializers.end()) continue;
    pb::TensorProto& t = *it->second;
    const Shape shape(t.dims().begin(), t.dims().end());
    if (shape != value.shape() || value.dtype() != DType::Float32 || !value.device().is_cpu()) {
      throw InvalidArgument(fmt::format("{}: initializer '{}' is float32 [{}], found {} [{}] on {} to write", source,
                                        name, fmt::join(shape, ", "), dtype_name(value.dtype()),
                                        fmt::join(value.shape(), ", "), value.device().str()));
    }
    t.clear_float_data();
    t.set_raw_data(value.data<float>(), static_cast<size_t>(value.numel()) * sizeof(float));
  }
  std::string bytes;
  if (!model.SerializeToString(&bytes)) {
    throw IoError(fmt::format("{}: the graph with its trained initializers could not be serialised", source));
  }
  return bytes;
}

Graph read_graph(const std::string& path) {
  const pb::ModelProto model = parse_file(path);
  try {
    pb::checker::check_model(model);
  } catch (const std::exception& e) {
    throw IoError(fmt::format("--model {}: ONNX's checker refuses the model: {}", path, e.what()));
  }
  Graph g;
  g.path = path;
  g.opset = default_opset(model);
  g.producer = fmt::format("{} {}", model.producer_name(), model.producer_version());
  if (g.opset < kMinOpset || g.opset > kMaxOpset) {
    throw InvalidArgument(fmt::format("--model {}: opset {} (written by {}), but mtrain reads opsets {} to {}: export "
                                      "with opset_version={}",
                                      path, g.opset, g.producer, kMinOpset, kMaxOpset, 14));
  }
  const pb::GraphProto& graph = model.graph();
  for (const auto& t : graph.initializer()) g.initializers.emplace(t.name(), read_initializer(path, t));
  std::vector<const pb::ValueInfoProto*> inputs;
  for (const auto& v : graph.input()) {
    if (!g.initializers.count(v.name())) inputs.push_back(&v);
  }
  if (inputs.size() != 1 || graph.output_size() != 1) {
    throw InvalidArgument(fmt::format("--model {}: the graph has {} inputs and {} outputs besides its weights; mtrain "
                                      "trains a graph of one image input and one output (the logits)",
                                      path, inputs.size(), graph.output_size()));
  }
  g.input = inputs.front()->name();
  g.input_shape = dims_of(*inputs.front());
  g.output = graph.output(0).name();
  read_nodes(graph, g);
  return g;
}

// Note [A float attribute's decimal]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ONNX stores float attributes in float32: PyTorch's batch norm eps, the Python number 1e-5 that
// its module computes with in double, arrives as 9.99999974737875e-06. Where var + eps rounds
// differently with the two (a channel of small variance), the graph's inverse deviation would
// differ from the module's, and from the built-in model's, by an ulp. The shortest decimal that
// reads back as the same float32 is the number that was written: 1e-05.
double written_decimal(float value) {
  char text[32];
  const auto [end, ec] = std::to_chars(text, text + sizeof text, value);
  double decimal = value;
  if (ec == std::errc()) std::from_chars(text, end, decimal);
  return decimal;
}

}  // namespace mtrain::models::onnx
