#include "models/rewrites.h"

#include <algorithm>
#include <memory>

#include "core/error.h"
#include "models/activation.h"
#include "models/batchnorm.h"
#include "models/conv.h"
#include "models/flatten.h"
#include "models/identity.h"
#include "models/linear.h"
#include "models/pooling.h"
#include "models/residual.h"
#include "models/sequential.h"

namespace mtrain::models {

namespace {

// Calls `on_pair(sequential, i)` for every pair of neighbours (i, i + 1) of every
// Sequential, and `on_residual` for every Residual, in the subtree of `m`.
template <class OnPair, class OnResidual>
void visit(Module& m, const OnPair& on_pair, const OnResidual& on_residual) {
  if (auto* seq = dynamic_cast<Sequential*>(&m)) {
    for (size_t i = 0; i + 1 < seq->num_children(); ++i) on_pair(*seq, i);
  } else if (auto* res = dynamic_cast<Residual*>(&m)) {
    on_residual(*res);
  }
  for (size_t i = 0; i < m.num_children(); ++i) visit(m.child(i), on_pair, on_residual);
}

}  // namespace

int fuse_batchnorm(Module& root) {
  int folded = 0;
  visit(
      root,
      [&](Sequential& seq, size_t i) {
        auto* bn = dynamic_cast<BatchNorm2d*>(&seq.child(i));
        if (bn == nullptr || dynamic_cast<ReLU*>(&seq.child(i + 1)) == nullptr) return;
        bn->set_fused(true, /*relu=*/true);
        seq.replace_child(i + 1, std::make_unique<Identity>());
        ++folded;
      },
      [&](Residual& res) { folded += res.fuse_batchnorm() ? 2 : 0; });
  // The rest (a batch norm with no ReLU after it) still takes the fused per-channel step.
  for (const auto& [name, module] : root.named_modules()) {
    auto* bn = dynamic_cast<BatchNorm2d*>(module);
    if (bn != nullptr && !bn->fused()) bn->set_fused(true, /*relu=*/false);
  }
  return folded;
}

int use_channels_last(Module& root) {
  const auto modules = root.named_modules();
  const bool any_conv = std::any_of(modules.begin(), modules.end(),
                                    [](const auto& m) { return dynamic_cast<Conv2d*>(m.second) != nullptr; });
  if (!any_conv) return 0;
  // The layer that sees the model's input.
  Module* first = &root;
  while (dynamic_cast<Sequential*>(first) != nullptr && first->num_children() > 0) first = &first->child(0);
  auto* input_conv = dynamic_cast<Conv2d*>(first);
  if (input_conv == nullptr) {
    throw InvalidArgument(fmt::format("channels last: the model's input goes to a {} first; it needs a "
                                      "convolution there",
                                      first->type_name()));
  }
  // Check everything before changing anything.
  for (const auto& [name, m] : modules) {
    const bool switched = dynamic_cast<Conv2d*>(m) || dynamic_cast<BatchNorm2d*>(m) ||
                          dynamic_cast<AdaptiveAvgPool2d*>(m) || dynamic_cast<Flatten*>(m);
    const bool indifferent = dynamic_cast<ReLU*>(m) || dynamic_cast<Sigmoid*>(m) || dynamic_cast<Identity*>(m) ||
                             dynamic_cast<Linear*>(m) || dynamic_cast<Sequential*>(m) || dynamic_cast<Residual*>(m);
    if (!switched && !indifferent) {
      throw InvalidArgument(fmt::format("channels last: {} ({}) has no channels-last kernels; train this model "
                                        "without channels last",
                                        m->type_name(), name.empty() ? "the model" : name));
    }
  }
  int switched = 0;
  for (const auto& [name, m] : modules) {
    if (auto* conv = dynamic_cast<Conv2d*>(m)) {
      conv->set_channels_last(true, /*nchw_input=*/conv == input_conv);
    } else if (auto* bn = dynamic_cast<BatchNorm2d*>(m)) {
      bn->set_channels_last(true);
    } else if (auto* pool = dynamic_cast<AdaptiveAvgPool2d*>(m)) {
      pool->set_channels_last(true);
    } else if (auto* flatten = dynamic_cast<Flatten*>(m)) {
      flatten->set_channels_last(true);
    } else {
      continue;
    }
    ++switched;
  }
  return switched;
}

int skip_conv_bias(Module& root) {
  int skipped = 0;
  visit(
      root,
      [&](Sequential& seq, size_t i) {
        auto* conv = dynamic_cast<Conv2d*>(&seq.child(i));
        auto* bn = dynamic_cast<BatchNorm2d*>(&seq.child(i + 1));
        if (conv == nullptr || bn == nullptr || !conv->options().bias) return;
        conv->set_bias_skipped(true);
        bn->set_input_bias(&conv->bias());
        ++skipped;
      },
      [&](Residual& res) { skipped += res.skip_conv_bias() ? 2 : 0; });
  return skipped;
}

}  // namespace mtrain::models
