// Two weight files compared tensor by tensor, for the end-to-end tests that prove two
// ways of training give the same model (DDP vs one rank, resumed vs uninterrupted,
// mpirun or two hosts vs mtrain-launch). Names, order, dtypes and shapes must agree
// (a REQUIRE failure otherwise); then every element is compared, or (compare_training)
// the distance between the two is measured against how far training moved.
#pragma once

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "trainer/checkpoint/safetensors.h"

namespace mtrain::testing {

// How far two runs that train the same model on the same global batches may end apart (Note
// [Equivalence tolerance] in test_distributed_train.cpp).
constexpr double kEquivalenceTolerance = 1e-4;

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

// Two trainings a and b that left the same starting weights, compared relative to what
// they did: the parameters by ||a - b|| / ||b - start|| over all of them together (how
// much the two updates disagree, whatever the learning rate), the BatchNorm running
// statistics by the largest ||a - b|| / ||b|| of one tensor. Integer tensors (the
// batch counters) must be equal.
struct TrainingDifference {
  double update = 0.0;
  double statistics = 0.0;
  std::string describe() const {
    return fmt::format("updates differ by {:.3g} of their size, running statistics by {:.3g}", update,
                       statistics);
  }
};

inline TrainingDifference compare_training(const std::string& a_path, const std::string& b_path,
                                           const std::string& start_path) {
  const SafetensorsFile a = load_safetensors(a_path);
  const SafetensorsFile b = load_safetensors(b_path);
  const SafetensorsFile start = load_safetensors(start_path);
  REQUIRE(a.tensors.size() == b.tensors.size());
  REQUIRE(a.tensors.size() == start.tensors.size());
  const auto is_statistic = [](const std::string& name) {
    const auto ends_with = [&](const std::string& suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    return ends_with("running_mean") || ends_with("running_var");
  };
  double apart = 0.0, moved = 0.0;
  TrainingDifference d;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [name, x] = a.tensors[i];
    const auto& y = b.tensors[i].second;
    const auto& s = start.tensors[i].second;
    INFO("tensor " << name);
    REQUIRE(name == b.tensors[i].first);
    REQUIRE(name == start.tensors[i].first);
    REQUIRE(x.shape() == y.shape());
    REQUIRE(x.shape() == s.shape());
    REQUIRE(x.dtype() == y.dtype());
    if (x.dtype() != DType::Float32) {
      CHECK(std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0);
      continue;
    }
    double tensor_apart = 0.0, tensor_size = 0.0, tensor_moved = 0.0;
    for (int64_t k = 0; k < x.numel(); ++k) {
      const double xa = x.data<float>()[k], yb = y.data<float>()[k], st = s.data<float>()[k];
      tensor_apart += (xa - yb) * (xa - yb);
      tensor_size += yb * yb;
      tensor_moved += (yb - st) * (yb - st);
    }
    if (is_statistic(name)) {
      d.statistics = std::max(d.statistics, std::sqrt(tensor_apart / std::max(tensor_size, 1e-30)));
    } else {
      apart += tensor_apart;
      moved += tensor_moved;
    }
  }
  d.update = std::sqrt(apart / std::max(moved, 1e-30));
  return d;
}

}  // namespace mtrain::testing
