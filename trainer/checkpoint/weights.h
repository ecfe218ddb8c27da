// Model weights to and from safetensors files, under the PyTorch state_dict names of
// models/module.h (Note [Parameter names]), so a file loads into torch with
// load_state_dict and a torch-written file loads here.
#pragma once

#include <string>

#include "models/module.h"
#include "trainer/checkpoint/safetensors.h"

namespace mtrain {

// Metadata key naming the zoo model a weights file was saved from; a mismatch error
// quotes it.
inline constexpr const char* kWeightsModelKey = "mtrain.model";

// Every parameter, then every buffer, of `model`, as tensors sharing the model's
// storage (no copy).
NamedTensors model_state(models::Module& model);

// `state` with every tensor on the host: GPU tensors are copied (the file layer reads
// host memory only), host tensors are passed through without a copy.
NamedTensors on_host(const NamedTensors& state);

// Atomically writes model_state(model), copied to the host, with `metadata` (see
// save_safetensors).
void save_model_weights(const std::string& path, models::Module& model,
                        const SafetensorsMetadata& metadata = {});

// save_model_weights, and when that fails the weights of a finished run are not lost: they
// are written to the temporary directory instead (TMPDIR, else /tmp) as
// mtrain-final-PID.safetensors, and the IoError names the failure and where the weights
// are (or, when that write fails too, both reasons). Returns normally only when `path`
// was written.
void save_model_weights_or_keep(const std::string& path, models::Module& model,
                                const SafetensorsMetadata& metadata = {});

// Copies the tensors of `file` (read from `path`, for messages) into `destinations`,
// wherever those live (a model on a GPU receives host-to-device copies).
// Every destination name must be in the file with the same shape and dtype, and the
// file may hold nothing else; otherwise throws IoError listing the missing,
// unexpected and mismatched names, and copies nothing.
void load_state_into(const SafetensorsFile& file, const NamedTensors& destinations,
                     const std::string& path);

// load_safetensors(path) into model_state(model). Gradients and optimizer state are
// untouched: this starts a run from weights, it does not resume one.
void load_model_weights(const std::string& path, models::Module& model);

}  // namespace mtrain
