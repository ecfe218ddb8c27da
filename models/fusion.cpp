#include "models/fusion.h"

#include <memory>

#include "models/activation.h"
#include "models/batchnorm.h"
#include "models/conv.h"
#include "models/identity.h"
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
