#include "models/onnx/onnx_graph.h"

#include <fmt/format.h>
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <set>

#include "core/error.h"

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

Attribute read_attribute(const pb::AttributeProto& a) {
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
    default:
      break;  // tensors, graphs: no operator mtrain maps reads them
  }
  return out;
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

// A Constant node's value as float32: float, double, int32 or int64 numbers (a bound of Clip,
// a shape); nullopt for any other type.
std::optional<Tensor> constant_value(const std::string& path, const pb::TensorProto& t) {
  if (t.data_type() == pb::TensorProto::FLOAT) return read_initializer(path, t);
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
    case pb::TensorProto::DOUBLE:
      read(double{}, t.double_data_size(), [&t](int i) { return t.double_data(i); });
      break;
    default:
      return std::nullopt;
  }
  Tensor out = Tensor::empty(checked_shape(path, t, bytes, listed), DType::Float32);
  float* p = out.data<float>();
  for (size_t i = 0; i < static_cast<size_t>(out.numel()); ++i) p[i] = static_cast<float>(value(i));
  return out;
}

std::vector<int64_t> dims_of(const pb::ValueInfoProto& v) {
  std::vector<int64_t> dims;
  if (!v.type().has_tensor_type() || !v.type().tensor_type().has_shape()) return dims;
  for (const auto& d : v.type().tensor_type().shape().dim()) dims.push_back(d.has_dim_value() ? d.dim_value() : -1);
  return dims;
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
  for (int i = 0; i < graph.node_size(); ++i) {
    const pb::NodeProto& n = graph.node(i);
    // Constants, and casts of them (F.relu6 exports integer bounds cast to float), fold into
    // constant values.
    if (n.op_type() == "Constant" && n.domain().empty() && n.attribute_size() == 1 && n.attribute(0).name() == "value" &&
        n.output_size() == 1) {
      if (auto value = constant_value(path, n.attribute(0).t())) {
        g.initializers.emplace(n.output(0), std::move(*value));
        continue;
      }
    }
    // Only a cast to float or double keeps the value as constant_value holds it.
    const auto cast_to = [&] {
      for (const auto& a : n.attribute()) {
        if (a.name() == "to") return a.i();
      }
      return int64_t{0};
    };
    if (n.op_type() == "Cast" && n.domain().empty() && n.input_size() == 1 && n.output_size() == 1 &&
        (cast_to() == pb::TensorProto::FLOAT || cast_to() == pb::TensorProto::DOUBLE)) {
      if (const auto it = g.initializers.find(n.input(0)); it != g.initializers.end()) {
        g.initializers.emplace(n.output(0), it->second);
        continue;
      }
    }
    Node node;
    node.index = i;
    node.name = n.name();
    node.op_type = n.domain().empty() || n.domain() == "ai.onnx" ? n.op_type() : n.domain() + "." + n.op_type();
    node.inputs.assign(n.input().begin(), n.input().end());
    node.outputs.assign(n.output().begin(), n.output().end());
    for (const auto& a : n.attribute()) node.attributes.emplace(a.name(), read_attribute(a));
    g.nodes.push_back(std::move(node));
  }
  return g;
}

}  // namespace mtrain::models::onnx
