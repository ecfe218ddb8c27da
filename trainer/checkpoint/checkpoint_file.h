// Training checkpoints: everything a run needs to continue exactly where it stopped,
// in one safetensors file (--checkpoint-dir DIR holds DIR/checkpoint.safetensors).
//
// Note [Checkpoint contents]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Tensors: every model parameter and buffer under its state_dict name (so the file
// also works as --init-from weights once the optimizer entries are dropped, and loads
// into torch the same way), then the SGD momentum buffers as
// "optimizer.momentum_buffer.<parameter name>" (absent before the first step or
// without momentum, as torch's optimizer state). Metadata (strings, see Note
// [safetensors layout]):
//   mtrain.checkpoint_version   kCheckpointVersion; another value is refused
//   mtrain.model                the zoo model, as in weights files
//   mtrain.position.*           the TrainPosition (epoch, steps, totals so far, and
//                               the loss scaler's state when there is one)
//   mtrain.config.<item>        each item of the run configuration that must match
// The file is written atomically and checksummed (Note [Atomic writes]), so a kill in
// the middle of a save leaves the previous checkpoint, and a torn or altered file is
// refused on load rather than resumed from.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "models/module.h"
#include "models/optim.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/loop/train_loop.h"

namespace mtrain {

inline constexpr const char* kCheckpointFileName = "checkpoint.safetensors";
// The checkpoint before the latest, kept so that one damaged file does not mean starting
// over (Note [The previous checkpoint] in checkpointer.cpp).
inline constexpr const char* kPreviousCheckpointFileName = "checkpoint.previous.safetensors";
inline constexpr const char* kCheckpointVersionKey = "mtrain.checkpoint_version";
inline constexpr const char* kCheckpointVersion = "1";

// The settings that must be the same for a checkpoint to be resumed, as (name, value)
// pairs in a fixed order, e.g. ("--batch-size", "32"), ("world size", "2").
using RunConfiguration = std::vector<std::pair<std::string, std::string>>;

// DIR/checkpoint.safetensors.
std::string checkpoint_path(const std::string& dir);
// DIR/checkpoint.previous.safetensors.
std::string previous_checkpoint_path(const std::string& dir);

// Atomically writes the model's parameters and buffers, the optimizer's momentum
// buffers, `position` and `configuration` to `path` (Note [Checkpoint contents]).
// Throws IoError when writing fails.
void save_training_checkpoint(const std::string& path, models::Module& model, models::Sgd& optimizer,
                              const TrainPosition& position, const RunConfiguration& configuration);

// Reads `path`, checks it and restores the model and the momentum buffers; returns the
// position to continue from. Throws IoError when the file is unreadable, corrupt,
// truncated or not an mtrain checkpoint, and InvalidArgument naming every item of
// `expected` that differs from what the checkpoint was written with. Nothing is
// restored unless every check passes.
TrainPosition load_training_checkpoint(const std::string& path, models::Module& model, models::Sgd& optimizer,
                                       const RunConfiguration& expected);

}  // namespace mtrain
