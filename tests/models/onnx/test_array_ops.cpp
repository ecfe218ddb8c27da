// ONNX's operators on small arrays (models/onnx/array_ops.h), against values worked out
// from ONNX's operator definitions.
#include <catch2/catch.hpp>

#include <cmath>

#include "core/error.h"
#include "models/onnx/array_ops.h"
#include "models/onnx/onnx_graph.h"

using namespace mtrain;
using namespace mtrain::models::onnx;

namespace {

Array ints(std::vector<int64_t> dims, std::vector<double> values) { return {std::move(dims), std::move(values), true}; }
Array floats(std::vector<int64_t> dims, std::vector<double> values) { return {std::move(dims), std::move(values), false}; }

Node node(const std::string& op, size_t inputs, std::map<std::string, Attribute> attributes = {}) {
  Node n;
  n.op_type = op;
  n.name = "/" + op;
  n.inputs.assign(inputs, "x");
  n.outputs = {"y"};
  n.attributes = std::move(attributes);
  return n;
}

Attribute int_attribute(int64_t i) {
  Attribute a;
  a.kind = Attribute::Kind::kInt;
  a.i = i;
  return a;
}

Attribute ints_attribute(std::vector<int64_t> values) {
  Attribute a;
  a.kind = Attribute::Kind::kInts;
  a.ints = std::move(values);
  return a;
}

Array run(const Node& n, const std::vector<const Array*>& inputs) {
  return evaluate("test.onnx", n, inputs);
}

void require_array(const Array& a, const std::vector<int64_t>& dims, const std::vector<double>& values, bool integer) {
  CHECK(a.dims == dims);
  CHECK(a.values == values);
  CHECK(a.integer == integer);
}

}  // namespace

TEST_CASE("array ops: arithmetic broadcasts, and integer division truncates", "[onnx]") {
  const Array column = ints({2, 1}, {7, -7}), row = ints({3}, {2, 3, 4});
  require_array(run(node("Div", 2), {&column, &row}), {2, 3}, {3, 2, 1, -3, -2, -1}, true);
  const Array half = floats({}, {0.5});
  require_array(run(node("Mul", 2), {&row, &half}), {3}, {1, 1.5, 2}, false);
  require_array(run(node("Sub", 2), {&column, &row}), {2, 3}, {5, 4, 3, -9, -10, -11}, true);
  const Array zero = ints({}, {0});
  CHECK_THROWS_AS(run(node("Div", 2), {&row, &zero}), InvalidArgument);
  const Array two = ints({2}, {1, 2});
  CHECK_THROWS_WITH(run(node("Add", 2), {&row, &two}), Catch::Contains("do not broadcast"));
}

TEST_CASE("array ops: the shape computations of an export (F.pad's paddings)", "[onnx]") {
  const Array image = floats({2, 3, 4, 5}, std::vector<double>(120, 0.0));
  const Array shape = run(node("Shape", 1), {&image});
  require_array(shape, {4}, {2, 3, 4, 5}, true);
  const Array last = ints({}, {-1});
  require_array(run(node("Gather", 2, {{"axis", int_attribute(0)}}), {&shape, &last}), {}, {5}, true);
  const Array axes = ints({1}, {0});
  require_array(run(node("Unsqueeze", 2), {&shape, &axes}), {1, 4}, {2, 3, 4, 5}, true);
  const Array count = ints({1}, {4});
  require_array(run(node("ConstantOfShape", 1), {&count}), {4}, {0, 0, 0, 0}, false);
  const Array pads = ints({4}, {1, 1, 2, 2});
  const Array to = ints({2}, {-1, 2});
  const Array pairs = run(node("Reshape", 2), {&pads, &to});
  require_array(pairs, {2, 2}, {1, 1, 2, 2}, true);
  require_array(run(node("Transpose", 1, {{"perm", ints_attribute({1, 0})}}), {&pairs}), {2, 2}, {1, 2, 1, 2}, true);
  // Reversed along axis 0 (start -1, end below the first, step -1), as F.pad's export does.
  const Array start = ints({1}, {-1}), end = ints({1}, {-1000}), axis = ints({1}, {0}), step = ints({1}, {-1});
  require_array(run(node("Slice", 5), {&pairs, &start, &end, &axis, &step}), {2, 2}, {2, 2, 1, 1}, true);
  const Array a = ints({2}, {0, 0});
  require_array(run(node("Concat", 2, {{"axis", int_attribute(0)}}), {&a, &pads}), {6}, {0, 0, 1, 1, 2, 2}, true);
  Node cast = node("Cast", 1, {{"to", int_attribute(7)}});
  const Array fractions = floats({2}, {2.7, -2.7});
  require_array(run(cast, {&fractions}), {2}, {2, -2}, true);
}

TEST_CASE("array ops refuse what their operator does not accept, naming the node", "[onnx]") {
  const Array v = ints({3}, {1, 2, 3});
  const Array far = ints({}, {3});
  CHECK_THROWS_WITH(run(node("Gather", 2), {&v, &far}), Catch::Contains("/Gather") && Catch::Contains("index 3"));
  const Array wrong = ints({1}, {4});
  CHECK_THROWS_WITH(run(node("Reshape", 2), {&v, &wrong}), Catch::Contains("reshapes [3] to [4]"));
  CHECK_THROWS_WITH(run(node("Transpose", 1, {{"perm", ints_attribute({0, 0})}}), {&v}), Catch::Contains("perm"));
  CHECK_THROWS_AS(run(node("Gather", 2), {&v, nullptr}), InvalidArgument);
  CHECK_FALSE(evaluates("Conv"));
  CHECK(evaluates("Shape"));
}

TEST_CASE("a float attribute reads as the decimal it was written as") {
  using mtrain::models::onnx::written_decimal;
  CHECK(written_decimal(1e-5f) == 1e-5);  // PyTorch's batch norm eps, not 9.99999974737875e-06
  CHECK(written_decimal(1e-3f) == 1e-3);
  CHECK(written_decimal(0.1f) == 0.1);
  CHECK(written_decimal(0.5f) == 0.5);
  CHECK(written_decimal(0.0f) == 0.0);
  // A float32 that no short decimal names keeps its value.
  const float odd = std::nextafter(1e-5f, 1.0f);
  CHECK(static_cast<float>(written_decimal(odd)) == odd);
}
