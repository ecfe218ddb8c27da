// Every layer, the loss and the module plumbing in one include (for the trainer and
// for tests); library code includes the single headers it uses.
#pragma once

#include "models/activation.h"  // ReLU, Sigmoid, Hardtanh, Hardsigmoid, Hardswish, Erf, Affine
#include "models/batchnorm.h"   // BatchNorm2d, BatchStats
#include "models/channel_scale.h"  // ChannelScale
#include "models/conv.h"        // Conv2d, Conv2dOptions
#include "models/flatten.h"     // Flatten
#include "models/rewrites.h"      // fuse_batchnorm, skip_conv_bias
#include "models/identity.h"    // Identity
#include "models/init.h"        // InitScheme, InitOptions, init_parameters
#include "models/layer_norm.h"  // LayerNorm
#include "models/linear.h"      // Linear
#include "models/loss.h"        // CrossEntropyLoss, LossResult
#include "models/module.h"      // Module, Parameter, replace_modules
#include "models/pooling.h"     // MaxPool2d, AvgPool2d, AdaptiveAvgPool2d
#include "models/residual.h"    // Residual
#include "models/sequential.h"  // Sequential, make_sequential
