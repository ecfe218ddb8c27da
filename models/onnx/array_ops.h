// ONNX's operators on small host arrays: the shapes, indices and paddings a graph computes
// beside its images. read_graph folds the nodes whose inputs are all constants with them
// (Note [Folding the export's constants] in onnx_graph.cpp).
#pragma once

#include <string>
#include <vector>

#include "models/onnx/onnx_graph.h"

namespace mtrain::models::onnx {

// Whether evaluate() computes `op_type` (Shape, Gather, Unsqueeze, Squeeze, Concat, Add, Sub,
// Mul, Div, Cast, ConstantOfShape, Reshape, Slice, Transpose, Identity).
bool evaluates(const std::string& op_type);

// The first output of `n` (of the graph at `path`, for messages) for `inputs` (one per input of `n`; nullptr where left out), with
// ONNX's broadcasting and integer arithmetic (division truncates). Throws InvalidArgument,
// naming the node, for inputs the operator does not accept (an index out of range, shapes
// that do not broadcast, a reshape to another element count) or an attribute or type it lacks.
Array evaluate(const std::string& path, const Node& n, const std::vector<const Array*>& inputs);

}  // namespace mtrain::models::onnx
