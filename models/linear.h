// Linear: y[N, out] = x[N, in] @ weight[out, in]^T + bias[out] (torch.nn.Linear); an input
// of more dimensions [N, ..., in] is rows of `in` features, as torch's (ConvNeXt's blocks
// apply linear layers to channels-last images).
#pragma once

#include <cstdint>

#include "models/module.h"

namespace mtrain::models {

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true);

  Tensor forward(const Tensor& x) override;
  Tensor backward(const Tensor& dy) override;
  std::string type_name() const override { return "Linear"; }
  void reset_parameters(ParameterInitializer& init) override;

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }  // value undefined without bias
  // The type the products are formed in (Note [Mixed precision] in mixed_precision.cpp).
  void set_compute_dtype(DType compute) { compute_ = compute; }
  DType compute_dtype() const { return compute_; }

 private:
  int64_t in_features_;
  int64_t out_features_;
  bool has_bias_;
  std::string description_;
  Parameter weight_;
  Parameter bias_;
  DType compute_ = DType::Float32;
  Tensor input_;        // as rows [R, in]
  Shape input_shape_;   // as given
  Shape output_shape_;
};

}  // namespace mtrain::models
