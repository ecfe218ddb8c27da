// A model read from an ONNX file (--model FILE.onnx): a network PyTorch exported in training
// mode, trained by mtrain. Every node becomes one of mtrain's layers (a child module, so
// SyncBatchNorm, --amp, the reducer's hooks and checkpoints see it as they see a built-in
// model's), run forward in the graph's topological order and backward in reverse, each
// value's gradient summed over the nodes that read it. Parameters and buffers carry the
// graph's initializer names, which are the exported module's state_dict names, and start
// with the initializers' values (Note [Graph models keep PyTorch's names] in graph_model.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/module.h"
#include "models/onnx/onnx_graph.h"

namespace mtrain::models::onnx {

// The ONNX operators a graph model maps onto layers, for messages.
const std::vector<std::string>& supported_operators();

class GraphModel : public Module {
 public:
  // Builds the layers of `graph`, with their initial values (InvalidArgument as
  // load_graph_model says).
  explicit GraphModel(const Graph& graph);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  void set_input_grad_needed(bool needed) override;
  std::string type_name() const override { return "GraphModel"; }

  // The image shape the graph was exported for, [C, H, W], -1 where left free.
  const std::vector<int64_t>& image_shape() const { return image_shape_; }

  // One node at run time: a layer (a child), an addition of two values, a concatenation of
  // several along the channels, a product of two (of one shape, or [N, C, ...] by one
  // value per image and channel), a reshape, transpose or channel slice of a value, or a
  // computation on arrays (a value's shape and what is computed from it: Note [Shapes
  // computed with the images] in graph_model.cpp).
  struct Step {
    enum class Kind { kLayer, kAdd, kConcat, kMul, kShape, kArray, kReshape, kTranspose, kSlice };
    Kind kind = Kind::kLayer;
    size_t child = 0;             // kLayer: its slot
    std::vector<int> inputs;      // value ids (one for a layer, two for Add and Mul, n for Concat)
    int output = 0;
    std::string node;             // the ONNX node, for messages
    int64_t axis = 1;             // kConcat: as given (negative counts from the end)
    std::vector<int64_t> channels;  // kConcat: each input's channels in the last forward
    std::vector<Tensor> saved;      // kMul: the last forward's inputs, until its backward
    std::shared_ptr<const Node> op; // kArray: the node to evaluate
    std::vector<int64_t> perm;      // kTranspose
    Shape input_shape;              // kReshape, kSlice: the last forward's input shape
    int64_t first = 0;              // kSlice: the last forward's first channel
  };

 private:
  struct Wiring;     // the graph's values by name while the nodes are added (graph_model.cpp)
  struct MadeLayer;  // a node's layer, the input it reads and the value it computes
  void add_node(const Node& node, Wiring& wiring);
  static Step array_step(const Node& n, Wiring& wiring);
  static Step layout_step(const Node& n, Wiring& wiring);
  static Step graph_step(const Node& n, Wiring& wiring);
  Step layer_step(const Node& n, Wiring& wiring);
  static MadeLayer make_layer(Wiring& wiring, const Node& n);
  static MadeLayer matmul_layer(Wiring& wiring, const Node& n);
  static MadeLayer constant_operand_layer(const Wiring& wiring, const Node& n, size_t k);
  void require_every_step_reaches_output(const Graph& graph) const;

  std::vector<Step> steps_;
  std::vector<std::pair<int, Array>> constant_arrays_;  // the constants array steps read, by value id
  std::string path_;          // for messages
  int64_t export_batch_ = -1; // the batch size the graph was exported with, -1 when left free
  int num_values_ = 0;
  int input_ = 0;   // value ids of the graph's input and output
  int output_ = 0;
  std::vector<int64_t> image_shape_;
};

// Reads `path` (onnx_graph.h) and builds its model for images of `channels` x `height` x
// `width` and `num_classes` classes. Throws IoError for a file that is no ONNX model and
// InvalidArgument, naming the node, for an operator outside supported_operators() (listing
// them), an attribute value its layer lacks (auto_pad SAME_*, a non-square pooling window,
// padding that differs between the ends of an axis, ...), a graph exported in eval mode
// (saying how to export it), or a graph whose input or output does not fit the data (naming
// both shapes).
std::unique_ptr<GraphModel> load_graph_model(const std::string& path, int64_t channels, int64_t height,
                                             int64_t width, int64_t num_classes);

}  // namespace mtrain::models::onnx
