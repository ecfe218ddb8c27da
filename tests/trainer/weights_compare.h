// Two weight files compared tensor by tensor, for the end-to-end tests that prove two
// ways of training give the same model (DDP vs one rank, resumed vs uninterrupted,
// mpirun or two hosts vs mtrain-launch). Names, order, dtypes and shapes must agree
// (a REQUIRE failure otherwise); then every element is compared.
#pragma once

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "trainer/safetensors.h"

namespace mtrain::testing {

struct WeightDifference {
  double max_abs = 0.0;   // largest |a - b| over the float32 elements
  int64_t differing = 0;  // elements whose bits differ, any dtype
  int64_t elements = 0;

  bool identical() const { return differing == 0; }
  std::string describe() const {
    return fmt::format("max |a - b| = {:.3g}, {} of {} elements differ in their bits", max_abs, differing,
                       elements);
  }
};

inline WeightDifference compare_weights(const SafetensorsFile& a, const SafetensorsFile& b) {
  REQUIRE(a.tensors.size() == b.tensors.size());
  WeightDifference d;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [name, x] = a.tensors[i];
    const auto& y = b.tensors[i].second;
    INFO("tensor " << name);
    REQUIRE(name == b.tensors[i].first);
    REQUIRE(x.shape() == y.shape());
    REQUIRE(x.dtype() == y.dtype());
    const size_t width = x.nbytes() / static_cast<size_t>(std::max<int64_t>(x.numel(), 1));
    const auto* px = static_cast<const unsigned char*>(x.raw_data());
    const auto* py = static_cast<const unsigned char*>(y.raw_data());
    for (int64_t k = 0; k < x.numel(); ++k) {
      if (std::memcmp(px + k * width, py + k * width, width) != 0) ++d.differing;
      if (x.dtype() == DType::Float32) {
        const double gap = std::fabs(static_cast<double>(x.data<float>()[k]) - y.data<float>()[k]);
        d.max_abs = std::max(d.max_abs, gap);
      }
    }
    d.elements += x.numel();
  }
  return d;
}

inline WeightDifference compare_weights(const std::string& a_path, const std::string& b_path) {
  return compare_weights(load_safetensors(a_path), load_safetensors(b_path));
}

}  // namespace mtrain::testing
