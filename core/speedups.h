// The speed switches: ways of computing a training step faster that are built and tested
// but not yet the default, each turned on by name in MTRAIN_SPEEDUPS.
//
// Note [Speed switches]
// ~~~~~~~~~~~~~~~~~~~~~
// A GPU is lent here rarely and briefly, so the candidates for a faster GPU step are built
// and tested without one and then measured side by side in one short window: each must
// be a switch that one run can turn on alone or together with the others, against the
// same build with all of them off. The ones that measure faster become the default and
// leave this list, the others leave the code. None changes what is trained beyond float
// rounding (each says how much), so ranks may differ in them; they apply on the CPU as on
// a GPU, but for amp-activations, which only GPU kernels make worth having. MTRAIN_SPEEDUPS
// is a comma-separated list of names, or `all`; empty or unset turns none on. docs/gpu.md
// lists them with what each does.
#pragma once

#include <string>
#include <vector>

namespace mtrain {

struct Speedups {
  bool fused_bn = false;        // batch norm with its ReLU (and residual add) in one pass
  bool skip_conv_bias = false;  // a convolution before a batch norm adds no bias
  bool fresh_grads = false;     // the first gradient write of a step overwrites (cuDNN beta 0)
  bool cudnn_graph = false;     // convolutions on cuDNN's graph API where it has an engine
  bool amp_activations = false;  // under --amp, activations between layers in 16 bits

  bool any() const { return fused_bn || skip_conv_bias || fresh_grads || cudnn_graph || amp_activations; }
  // "fused-bn, skip-conv-bias", or "none".
  std::string str() const;
  bool operator==(const Speedups&) const = default;
};

// The names MTRAIN_SPEEDUPS accepts, `all` aside.
std::vector<std::string> speedup_names();

// Parses a MTRAIN_SPEEDUPS value. An unknown name is InvalidArgument naming it, `source`
// (the variable) and every name accepted.
Speedups parse_speedups(const std::string& text, const std::string& source);

// MTRAIN_SPEEDUPS, parsed.
Speedups speedups_from_environment();

}  // namespace mtrain
