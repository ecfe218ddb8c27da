// An ONNX file read and checked (ONNX's checker), as plain data: the nodes in the file's
// topological order, each initializer as a float32 host tensor, the one image input and the
// one output. Only onnx_graph.cpp includes ONNX's and protobuf's headers. What the nodes mean
// to mtrain is graph_model.cpp's business.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace mtrain::models::onnx {

// A small array of numbers (a shape, indices, a bound), of ONNX's integer or bool types
// (`integer`) or floating point, held as doubles, which hold both exactly.
struct Array {
  std::vector<int64_t> dims;
  std::vector<double> values;
  bool integer = false;
};

struct Attribute {
  enum class Kind { kInt, kInts, kFloat, kFloats, kString, kTensor, kOther };
  Kind kind = Kind::kOther;
  int64_t i = 0;
  float f = 0;
  std::string s;
  std::vector<int64_t> ints;
  std::vector<float> floats;
  Array tensor;  // a tensor of numbers
};

// The number a float32 attribute was written as: the shortest decimal that reads back as
// `value` (1e-05 for float32(1e-5)), in double (Note [A float attribute's decimal]).
double written_decimal(float value);

struct Node {
  int index = 0;        // position in the graph
  std::string name;     // may be empty
  std::string op_type;  // "Conv", "Relu", ...
  std::vector<std::string> inputs;   // "" marks an optional input left out
  std::vector<std::string> outputs;
  std::map<std::string, Attribute> attributes;

  // "node 3 (Conv '/conv1/Conv')", for messages.
  std::string describe() const;
};

struct Graph {
  std::string path;
  int64_t opset = 0;          // of the default ("ai.onnx") domain
  std::string producer;       // "pytorch 1.13.0", for messages
  std::string input;          // the graph input that is not an initializer
  std::vector<int64_t> input_shape;  // its dimensions; -1 where symbolic or unknown
  std::string output;         // the graph's one output
  std::vector<Node> nodes;    // topologically sorted (the checker requires it), constants folded
  // The initializers, and as float32 the values of the Constant nodes (of numbers) and of
  // the nodes that compute from constants only (Note [Folding the export's constants] in
  // onnx_graph.cpp): constant inputs of the nodes that read them. float32, host.
  std::map<std::string, Tensor> initializers;
  // The same constants as arrays, for the shape computations that run with the images.
  std::map<std::string, Array> constants;
};

// The opsets graph_model knows the operators of: PyTorch 1.13 exports 14 by default.
constexpr int64_t kMinOpset = 9;
constexpr int64_t kMaxOpset = 17;

// The ONNX file at `source` with the initializers named in `values` (host float32 tensors of
// the initializers' shapes) holding those values instead, serialised: the same graph with
// trained weights. Values the graph has no initializer for are left out (a batch norm's
// num_batches_tracked, which the export drops). Throws IoError for a source that cannot be
// read and InvalidArgument for a value of another shape or type than its initializer.
std::string with_initializers(const std::string& source,
                              const std::vector<std::pair<std::string, Tensor>>& values);

// Reads and checks `path`; Constant nodes and what is computed from them alone become
// initializers. Throws IoError for a file that cannot be read or is no ONNX model
// (naming what was found), and InvalidArgument for a model mtrain cannot train as a graph:
// an opset outside [kMinOpset, kMaxOpset], other than one input and one output, an
// initializer that is not float32 or keeps its data in another file.
Graph read_graph(const std::string& path);

}  // namespace mtrain::models::onnx
