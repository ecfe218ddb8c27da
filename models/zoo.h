// The model zoo: every model mtrain-train can build by name. Structures are d2l's
// nn.Sequential models and torchvision's ResNets, so parameter names match torch's (Note
// [Parameter names]).
//   resnet18   d2l's ResNet-18 for small inputs (28x28, 32x32, any size): 3x3 stem conv (stride 1, padding 1),
//              BN, ReLU, no max-pool; 4 stages of 2 Residual blocks (64, 128, 256, 512
//              channels; stages 2-4 open with a stride-2 block with a 1x1 conv
//              shortcut); global average pool, flatten, linear.
//              Sequential(b1, b2, b3, b4, b5, AdaptiveAvgPool2d, Flatten, Linear).
//   lenet      d2l LeNet-5 with sigmoids and average pooling; needs 28x28 input.
//   mlp        flatten, 784*in_channels -> 256 -> num_classes with ReLU; needs 28x28.
//   simplecnn  two 3x3 convs (in -> 64 -> 128, padding 1, ReLU), global average pool,
//              flatten, linear 128 -> num_classes; any input size.
//   resnet34, resnet50  torchvision's, for ImageNet-size images (any size; 224x224 as
//              torchvision trains them): 7x7 stride-2 stem, max pooling, BasicBlocks or
//              Bottlenecks [3, 4, 6, 3], global average pool, fc; torchvision's names
//              (models/torchvision_resnet.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/init.h"
#include "models/module.h"

namespace mtrain::models {

// The names build_model accepts, in a fixed order.
const std::vector<std::string>& model_names();

// Builds and initialises `name`; an unknown name, in_channels < 1 or num_classes < 1
// is InvalidArgument (the message lists the known names). The model starts in train mode.
std::unique_ptr<Module> build_model(const std::string& name, int in_channels, int num_classes,
                                    const InitOptions& init = {});

// Whether --model names an ONNX file (it ends in ".onnx") rather than a model of the zoo.
bool is_onnx_file(const std::string& model);

// What --model names, for images of channels x height x width and `num_classes` classes: a
// model of the zoo (check_input_size, then build_model), or the graph of an ONNX file
// (models/onnx/graph_model.h), which starts from its initializers under InitScheme::kGraph
// and is initialised afresh under any other scheme. Throws InvalidArgument (and IoError for
// an ONNX file that cannot be read) as those do.
std::unique_ptr<Module> build_model_for_images(const std::string& model, int64_t channels, int64_t height,
                                               int64_t width, int64_t num_classes, const InitOptions& init);

// Throws InvalidArgument when model `name` cannot take height x width images (lenet and
// mlp are built for 28x28); the message names the models that can. Unknown names pass
// (build_model reports them).
void check_input_size(const std::string& name, int64_t height, int64_t width);

}  // namespace mtrain::models
