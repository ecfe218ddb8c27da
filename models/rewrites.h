// Rewrites of a model, in place, that change how it computes but not what: parameter
// and buffer names, shapes and values, and the function the model computes, stay those
// of the model as built (bitwise where stated). Run them after convert_sync_batchnorm
// (which carries their settings over anyway) and before anything hooks into the
// parameters (the reducer): fuse_batchnorm replaces modules.
//
// Note [Conv bias before a batch norm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A training-mode batch norm subtracts its batch's mean from every channel, so a
// per-channel constant added before it, the bias of the convolution that feeds it, never
// reaches its output, and that bias's gradient is zero in exact arithmetic (float
// arithmetic leaves rounding noise, some 1e-9 of the other gradients). Adding the bias
// costs a read and a write of the convolution's output, and its gradient a read of the
// output gradient. With the bias skipped, the batch norm accounts for it where it does
// matter: its running mean tracks the batch mean plus the bias, and eval mode subtracts
// the bias from the running mean before normalising. What a run saves is what PyTorch's
// model holds: the conv bias keeps its value (its gradient is exactly 0, so only weight
// decay moves it, as it would move PyTorch's), and running_mean is the mean of the
// convolution's output with the bias, as PyTorch's layer sees it. Outputs agree with the
// unskipped model to float rounding, not bitwise (the bias is added to the mean instead
// of to every element).
#pragma once

#include "models/module.h"

namespace mtrain::models {

// Every BatchNorm2d computes with the fused kernels (batchnorm_prepare); one followed by
// a ReLU in a Sequential does that ReLU itself, and the ReLU's slot gets an Identity;
// in a Residual, bn1 does the ReLU after it and bn2 the add and the ReLU (Residual::
// fuse_batchnorm). Outputs and gradients are bitwise the unfused model's (Note [Fused
// batch norm] in tensor/ops.h). Returns how many ReLUs were folded in.
int fuse_batchnorm(Module& root);

// Every Conv2d with a bias that directly feeds a BatchNorm2d (the next child in a
// Sequential; conv1 and conv2 in a Residual) skips its bias, which the batch norm takes
// into account instead (Note [Conv bias before a batch norm]). Returns how many
// convolutions skip their bias.
int skip_conv_bias(Module& root);

// Note [Channels-last models]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Keeps every activation of `root` channels last (Note [Channels last] in tensor/ops.h):
// each Conv2d, BatchNorm2d (SyncBatchNorm too), AdaptiveAvgPool2d and Flatten is told, the
// layers that do not care (ReLU, Sigmoid, Identity, Linear after a Flatten, the
// containers) stay as they are. The model still takes [N, C, H, W] images and gives what
// it gave: the convolution that sees the model's input lays it out (a view for one
// channel), and Flatten gives PyTorch's (c, h, w) order. Results differ from NCHW by the
// order of batch norm's sums, that is by float rounding. InvalidArgument, changing
// nothing, for a layer without channels-last kernels (MaxPool2d, AvgPool2d) or unknown
// here, or a model whose input does not go to a convolution first (through the first
// child of Sequentials). Returns how many layers were switched; 0 for a model with no
// convolution, which has no layout to choose.
int use_channels_last(Module& root);

}  // namespace mtrain::models
