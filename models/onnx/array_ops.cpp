#include "models/onnx/array_ops.h"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <numeric>

#include "core/error.h"

namespace mtrain::models::onnx {

namespace {

// ONNX's TensorProto data types (onnx.proto), for Cast's `to`.
constexpr int64_t kFloat = 1, kBool = 9, kFloat16 = 10, kDouble = 11, kBFloat16 = 16;

[[noreturn]] void refuse(const std::string& path, const Node& n, const std::string& what) {
  throw InvalidArgument(fmt::format("--model {}: {}: {}", path, n.describe(), what));
}

int64_t count(const std::vector<int64_t>& dims) {
  return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<>());
}

std::vector<int64_t> strides_of(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (size_t d = dims.size(); d-- > 1;) strides[d - 1] = strides[d] * dims[d];
  return strides;
}

// The arguments of one evaluation, with the checks every operator needs.
struct Call {
  const std::string& path;  // the graph's, for messages
  const Node& n;
  const std::vector<const Array*>& inputs;

  const Array& in(size_t i) const {
    if (i >= inputs.size() || inputs[i] == nullptr) refuse(path, n, fmt::format("input {} is missing", i));
    return *inputs[i];
  }
  bool has(size_t i) const { return i < inputs.size() && inputs[i] != nullptr; }
  // Input `i` as integers (indices, axes, a shape).
  std::vector<int64_t> ints(size_t i) const {
    const Array& a = in(i);
    std::vector<int64_t> out;
    for (double v : a.values) out.push_back(static_cast<int64_t>(v));
    return out;
  }
  int64_t int_attribute(const std::string& name, int64_t fallback) const {
    const auto it = n.attributes.find(name);
    return it == n.attributes.end() ? fallback : it->second.i;
  }
  std::vector<int64_t> ints_attribute(const std::string& name) const {
    const auto it = n.attributes.find(name);
    return it == n.attributes.end() ? std::vector<int64_t>{} : it->second.ints;
  }
  // `axis` of an array of `rank` dimensions, negative counting from the end.
  int64_t axis(int64_t axis, int64_t rank) const {
    const int64_t a = axis < 0 ? axis + rank : axis;
    if (a < 0 || a >= rank) refuse(path, n, fmt::format("axis {} of an array of {} dimensions", axis, rank));
    return a;
  }
  // Axes from the input `i` (later opsets) or the attribute "axes" (earlier ones).
  std::vector<int64_t> axes(size_t i) const { return has(i) ? ints(i) : ints_attribute("axes"); }
};

Array binary(const Call& c, const std::function<double(double, double)>& f, bool integer_division) {
  const Array &a = c.in(0), &b = c.in(1);
  // Numpy's broadcasting: the shapes aligned at their ends, a dimension of 1 stretched.
  const size_t rank = std::max(a.dims.size(), b.dims.size());
  const auto aligned = [rank](const std::vector<int64_t>& dims) {
    std::vector<int64_t> out(rank - dims.size(), 1);
    out.insert(out.end(), dims.begin(), dims.end());
    return out;
  };
  const std::vector<int64_t> da = aligned(a.dims), db = aligned(b.dims);
  Array out;
  out.integer = a.integer && b.integer;
  for (size_t d = 0; d < rank; ++d) {
    if (da[d] != db[d] && da[d] != 1 && db[d] != 1) {
      refuse(c.path, c.n, fmt::format("shapes [{}] and [{}] do not broadcast", fmt::join(a.dims, ", "),
                                   fmt::join(b.dims, ", ")));
    }
    out.dims.push_back(da[d] == 1 ? db[d] : da[d]);
  }
  const std::vector<int64_t> sa = strides_of(da), sb = strides_of(db), so = strides_of(out.dims);
  for (int64_t i = 0; i < count(out.dims); ++i) {
    int64_t ia = 0, ib = 0;
    for (size_t d = 0; d < rank; ++d) {
      const int64_t at = i / so[d] % out.dims[d];
      ia += da[d] == 1 ? 0 : at * sa[d];
      ib += db[d] == 1 ? 0 : at * sb[d];
    }
    const double x = a.values[static_cast<size_t>(ia)], y = b.values[static_cast<size_t>(ib)];
    if (integer_division && out.integer) {
      if (y == 0) refuse(c.path, c.n, "an integer division by zero");
      out.values.push_back(std::trunc(x / y));
    } else {
      out.values.push_back(f(x, y));
    }
  }
  return out;
}

Array gather(const Call& c) {
  const Array& data = c.in(0);
  const Array& indices = c.in(1);
  const int64_t rank = static_cast<int64_t>(data.dims.size());
  const int64_t axis = c.axis(c.int_attribute("axis", 0), rank);
  const int64_t outer = count({data.dims.begin(), data.dims.begin() + axis});
  const int64_t inner = count({data.dims.begin() + axis + 1, data.dims.end()});
  const int64_t size = data.dims[static_cast<size_t>(axis)];
  Array out{{data.dims.begin(), data.dims.begin() + axis}, {}, data.integer};
  out.dims.insert(out.dims.end(), indices.dims.begin(), indices.dims.end());
  out.dims.insert(out.dims.end(), data.dims.begin() + axis + 1, data.dims.end());
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t index : c.ints(1)) {
      const int64_t at = index < 0 ? index + size : index;
      if (at < 0 || at >= size) refuse(c.path, c.n, fmt::format("index {} of a dimension of {}", index, size));
      for (int64_t i = 0; i < inner; ++i) out.values.push_back(data.values[static_cast<size_t>((o * size + at) * inner + i)]);
    }
  }
  return out;
}

Array unsqueeze(const Call& c) {
  Array out = c.in(0);
  std::vector<int64_t> axes = c.axes(1);
  const int64_t rank = static_cast<int64_t>(out.dims.size() + axes.size());
  for (int64_t& a : axes) a = c.axis(a, rank);
  std::sort(axes.begin(), axes.end());
  for (int64_t a : axes) out.dims.insert(out.dims.begin() + a, 1);
  return out;
}

Array squeeze(const Call& c) {
  Array out = c.in(0);
  std::vector<int64_t> axes = c.axes(1);
  const int64_t rank = static_cast<int64_t>(out.dims.size());
  for (int64_t& a : axes) a = c.axis(a, rank);
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < rank; ++d) {
    const bool named = std::find(axes.begin(), axes.end(), d) != axes.end();
    const int64_t size = out.dims[static_cast<size_t>(d)];
    if (named && size != 1) refuse(c.path, c.n, fmt::format("squeezes axis {} of size {}", d, size));
    if (!(named || (axes.empty() && size == 1))) dims.push_back(size);
  }
  out.dims = dims;
  return out;
}

Array concat(const Call& c) {
  const Array& first = c.in(0);
  const int64_t rank = static_cast<int64_t>(first.dims.size());
  const int64_t axis = c.axis(c.int_attribute("axis", 0), rank);
  Array out{first.dims, {}, true};
  out.dims[static_cast<size_t>(axis)] = 0;
  const int64_t outer = count({first.dims.begin(), first.dims.begin() + axis});
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    const Array& a = c.in(i);
    std::vector<int64_t> other = a.dims, expected = first.dims;
    if (other.size() == expected.size()) other[static_cast<size_t>(axis)] = expected[static_cast<size_t>(axis)];
    if (other != expected) {
      refuse(c.path, c.n, fmt::format("concatenates [{}] and [{}]", fmt::join(first.dims, ", "), fmt::join(a.dims, ", ")));
    }
    out.dims[static_cast<size_t>(axis)] += a.dims[static_cast<size_t>(axis)];
    out.integer = out.integer && a.integer;
  }
  for (int64_t o = 0; o < outer; ++o) {
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      const Array& a = c.in(i);
      const int64_t block = count({a.dims.begin() + axis, a.dims.end()});
      out.values.insert(out.values.end(), a.values.begin() + o * block, a.values.begin() + (o + 1) * block);
    }
  }
  return out;
}

Array cast(const Call& c) {
  Array out = c.in(0);
  const int64_t to = c.int_attribute("to", 0);
  out.integer = !(to == kFloat || to == kFloat16 || to == kDouble || to == kBFloat16);
  if (!out.integer) return out;
  for (double& v : out.values) v = to == kBool ? (v != 0 ? 1 : 0) : std::trunc(v);
  return out;
}

Array constant_of_shape(const Call& c) {
  const auto it = c.n.attributes.find("value");
  Array fill{{1}, {0.0}, false};
  if (it != c.n.attributes.end()) fill = it->second.tensor;
  if (fill.values.size() != 1) refuse(c.path, c.n, "a fill value that is not one number");
  const std::vector<int64_t> dims = c.ints(0);
  for (int64_t d : dims) {
    if (d < 0 || d > (int64_t{1} << 20)) refuse(c.path, c.n, fmt::format("an array of shape [{}]", fmt::join(dims, ", ")));
  }
  if (count(dims) > (int64_t{1} << 20)) refuse(c.path, c.n, fmt::format("an array of shape [{}]", fmt::join(dims, ", ")));
  return {dims, std::vector<double>(static_cast<size_t>(count(dims)), fill.values[0]), fill.integer};
}

Array reshape(const Call& c) {
  Array out = c.in(0);
  std::vector<int64_t> dims = c.ints(1);
  const bool allow_zero = c.int_attribute("allowzero", 0) != 0;
  int64_t known = 1, inferred = -1;
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d] == 0 && !allow_zero) {
      if (d >= out.dims.size()) refuse(c.path, c.n, "copies a dimension the input lacks");
      dims[d] = out.dims[d];
    }
    if (dims[d] == -1) {
      if (inferred >= 0) refuse(c.path, c.n, "a shape with two -1");
      inferred = static_cast<int64_t>(d);
    } else {
      known *= dims[d];
    }
  }
  const int64_t total = count(out.dims);
  if (inferred >= 0 && known > 0) dims[static_cast<size_t>(inferred)] = total / known;
  if (count(dims) != total) {
    refuse(c.path, c.n, fmt::format("reshapes [{}] to [{}]", fmt::join(out.dims, ", "), fmt::join(c.ints(1), ", ")));
  }
  out.dims = dims;
  return out;
}

Array slice(const Call& c) {
  const Array& data = c.in(0);
  const int64_t rank = static_cast<int64_t>(data.dims.size());
  // Inputs from opset 10, attributes before it.
  const std::vector<int64_t> starts = c.has(1) ? c.ints(1) : c.ints_attribute("starts");
  const std::vector<int64_t> ends = c.has(2) ? c.ints(2) : c.ints_attribute("ends");
  std::vector<int64_t> axes = c.axes(3);
  std::vector<int64_t> steps = c.has(4) ? c.ints(4) : std::vector<int64_t>(starts.size(), 1);
  if (axes.empty()) {
    for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
  }
  if (ends.size() != starts.size() || axes.size() != starts.size() || steps.size() != starts.size()) {
    refuse(c.path, c.n, "starts, ends, axes and steps of different lengths");
  }
  // Per dimension: the first index taken, the step, the count.
  std::vector<int64_t> first(static_cast<size_t>(rank), 0), step(static_cast<size_t>(rank), 1), dims = data.dims;
  for (size_t i = 0; i < starts.size(); ++i) {
    const size_t a = static_cast<size_t>(c.axis(axes[i], rank));
    const int64_t size = data.dims[a], s = steps[i];
    if (s == 0) refuse(c.path, c.n, "a step of 0");
    const auto clamp = [&](int64_t v, int64_t lo, int64_t hi) {
      v = v < 0 ? v + size : v;
      return std::min(std::max(v, lo), hi);
    };
    const int64_t begin = s > 0 ? clamp(starts[i], 0, size) : clamp(starts[i], -1, size - 1);
    const int64_t end = s > 0 ? clamp(ends[i], 0, size) : clamp(ends[i], -1, size - 1);
    first[a] = begin;
    step[a] = s;
    dims[a] = s > 0 ? std::max<int64_t>(0, (end - begin + s - 1) / s) : std::max<int64_t>(0, (begin - end - s - 1) / -s);
  }
  Array out{dims, {}, data.integer};
  const std::vector<int64_t> from = strides_of(data.dims), to = strides_of(dims);
  for (int64_t i = 0; i < count(dims); ++i) {
    int64_t at = 0;
    for (size_t d = 0; d < dims.size(); ++d) at += (first[d] + (i / to[d] % dims[d]) * step[d]) * from[d];
    out.values.push_back(data.values[static_cast<size_t>(at)]);
  }
  return out;
}

Array transpose(const Call& c) {
  const Array& data = c.in(0);
  const size_t rank = data.dims.size();
  std::vector<int64_t> perm = c.ints_attribute("perm");
  if (perm.empty()) {
    for (size_t d = rank; d-- > 0;) perm.push_back(static_cast<int64_t>(d));
  }
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (size_t d = 0; d < rank; ++d) {
    if (sorted.size() != rank || sorted[d] != static_cast<int64_t>(d)) {
      refuse(c.path, c.n, fmt::format("perm [{}] for {} dimensions", fmt::join(perm, ", "), rank));
    }
  }
  Array out{{}, {}, data.integer};
  for (int64_t p : perm) out.dims.push_back(data.dims[static_cast<size_t>(p)]);
  const std::vector<int64_t> from = strides_of(data.dims), to = strides_of(out.dims);
  for (int64_t i = 0; i < count(out.dims); ++i) {
    int64_t at = 0;
    for (size_t d = 0; d < rank; ++d) at += (i / to[d] % out.dims[d]) * from[static_cast<size_t>(perm[d])];
    out.values.push_back(data.values[static_cast<size_t>(at)]);
  }
  return out;
}

using Evaluation = std::function<Array(const Call&)>;

const std::map<std::string, Evaluation>& evaluations() {
  static const std::map<std::string, Evaluation> table = {
      {"Shape",
       [](const Call& c) {
         Array out{{static_cast<int64_t>(c.in(0).dims.size())}, {}, true};
         for (int64_t d : c.in(0).dims) out.values.push_back(static_cast<double>(d));
         return out;
       }},
      {"Identity", [](const Call& c) { return c.in(0); }},
      {"Gather", gather},
      {"Unsqueeze", unsqueeze},
      {"Squeeze", squeeze},
      {"Concat", concat},
      {"Add", [](const Call& c) { return binary(c, std::plus<>(), false); }},
      {"Sub", [](const Call& c) { return binary(c, std::minus<>(), false); }},
      {"Mul", [](const Call& c) { return binary(c, std::multiplies<>(), false); }},
      {"Div", [](const Call& c) { return binary(c, std::divides<>(), true); }},
      {"Cast", cast},
      {"ConstantOfShape", constant_of_shape},
      {"Reshape", reshape},
      {"Slice", slice},
      {"Transpose", transpose},
  };
  return table;
}

}  // namespace

bool evaluates(const std::string& op_type) { return evaluations().count(op_type) != 0; }

Array evaluate(const std::string& path, const Node& n, const std::vector<const Array*>& inputs) {
  const auto it = evaluations().find(n.op_type);
  if (it == evaluations().end()) refuse(path, n, "an operator mtrain does not compute on arrays");
  Array out = it->second(Call{path, n, inputs});
  if (static_cast<int64_t>(out.values.size()) != count(out.dims)) {
    refuse(path, n, fmt::format("computed {} values for the shape [{}]", out.values.size(), fmt::join(out.dims, ", ")));
  }
  return out;
}

}  // namespace mtrain::models::onnx
