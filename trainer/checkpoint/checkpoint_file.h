// Training checkpoints: everything a run needs to continue exactly where it stopped, in one
// safetensors file (--checkpoint-dir DIR holds DIR/checkpoint.safetensors). The file holds the
// model's state_dict, the SGD momentum buffers, the TrainPosition and the run configuration (Note
// [Checkpoint contents] in checkpoint_file.cpp); it is written atomically and checksummed, so a
// torn or altered file is refused rather than resumed from. These functions touch the file only:
// which rank calls them is checkpointer.h's business.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "models/module.h"
#include "models/optim.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/loop/train_loop.h"

namespace mtrain {

// The most earlier worlds one epoch's position carries (TrainPosition::earlier_segments;
// the resume header has room for them).
inline constexpr size_t kMaxEarlierSegments = 64;

inline constexpr const char* kCheckpointFileName = "checkpoint.safetensors";
// The checkpoint before the latest, kept so that one damaged file does not mean starting
// over (Note [The previous checkpoint] in checkpointer.cpp).
inline constexpr const char* kPreviousCheckpointFileName = "checkpoint.previous.safetensors";
// A save's new checkpoint until it is checked and moved into place.
inline constexpr const char* kIncomingCheckpointFileName = "checkpoint.incoming.safetensors";
// A latest checkpoint found damaged, set aside where no resume reads it.
inline constexpr const char* kDamagedCheckpointFileName = "checkpoint.damaged.safetensors";
inline constexpr const char* kCheckpointVersionKey = "mtrain.checkpoint_version";
inline constexpr const char* kCheckpointVersion = "1";

// The settings that must be the same for a checkpoint to be resumed, as (name, value)
// pairs in a fixed order, e.g. ("--batch-size", "32"), ("world size", "2").
using RunConfiguration = std::vector<std::pair<std::string, std::string>>;

// DIR/checkpoint.safetensors.
std::string checkpoint_path(const std::string& dir);
// DIR/checkpoint.previous.safetensors.
std::string previous_checkpoint_path(const std::string& dir);
// DIR/checkpoint.incoming.safetensors.
std::string incoming_checkpoint_path(const std::string& dir);
// DIR/checkpoint.damaged.safetensors.
std::string damaged_checkpoint_path(const std::string& dir);

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
