#include "trainer/checkpoint/checkpoint_file.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <utility>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>

#include "core/error.h"
#include "trainer/checkpoint/weights.h"

// Note [Checkpoint contents]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Tensors: every model parameter and buffer under its state_dict name (so the file also works as
// --init-from weights once the optimizer entries are dropped, and loads into torch the same way),
// then the SGD momentum buffers as "optimizer.momentum_buffer.<parameter name>" (absent before the
// first step or without momentum, as torch's optimizer state). Metadata (strings, see Note
// [safetensors layout]):
//   mtrain.checkpoint_version   kCheckpointVersion; another value is refused
//   mtrain.model                the zoo model, as in weights files
//   mtrain.position.*           the TrainPosition (epoch, steps, totals so far, and the loss
//                               scaler's state when there is one)
//   mtrain.config.<item>        each item of the run configuration that must match
// The file is written atomically and checksummed (Note [Atomic writes]), so a kill in the middle
// of a save leaves the previous checkpoint, and a torn or altered file is refused on load rather
// than resumed from.

namespace mtrain {

namespace {

constexpr const char* kConfigPrefix = "mtrain.config.";
constexpr const char* kMomentumPrefix = "optimizer.momentum_buffer.";

constexpr const char* kEpochKey = "mtrain.position.epoch";
constexpr const char* kStepsInEpochKey = "mtrain.position.steps_in_epoch";
constexpr const char* kTotalStepsKey = "mtrain.position.total_steps";
constexpr const char* kEpochFinishedKey = "mtrain.position.epoch_finished";
constexpr const char* kLossSumKey = "mtrain.position.epoch_loss_sum";
constexpr const char* kCorrectKey = "mtrain.position.epoch_correct";
constexpr const char* kImagesKey = "mtrain.position.epoch_images";
constexpr const char* kTrainSecondsKey = "mtrain.position.epoch_train_seconds";
// Only with a loss scaler (Note [Dynamic loss scaling]).
constexpr const char* kLossScaleKey = "mtrain.position.loss_scale";
constexpr const char* kLossScaleGoodStepsKey = "mtrain.position.loss_scale_good_steps";
constexpr const char* kSkippedStepsKey = "mtrain.position.skipped_steps";
// Absent from checkpoints written before it was recorded: read as 0.
constexpr const char* kConsecutiveSkipsKey = "mtrain.position.consecutive_skipped_steps";
// Absent from checkpoints written before a resume could change the world size (Note
// [Resuming in another world]); those recorded the world as the configuration item below.
constexpr const char* kWorldSizeKey = "mtrain.position.world_size";
constexpr const char* kEpochConsumedKey = "mtrain.position.epoch_consumed";
// "WORLD:CONSUMED,..." oldest first; absent when the epoch had no earlier world.
constexpr const char* kEarlierSegmentsKey = "mtrain.position.earlier_segments";
constexpr const char* kLegacyWorldSizeItem = "world size";

// What to do about a checkpoint that cannot be used, appended to every such error.
constexpr const char* kFreshStartHint =
    "delete it or choose another --checkpoint-dir to start a fresh run";

const std::string& required(const SafetensorsMetadata& metadata, const char* key, const std::string& path) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) {
    throw IoError(fmt::format("checkpoint {} has no \"{}\" entry in its metadata; {}", path, key, kFreshStartHint));
  }
  return it->second;
}

// kEarlierSegmentsKey's "WORLD:CONSUMED,..." (worlds >= 1, at most kMaxEarlierSegments).
std::vector<EpochSegment> parse_segments(const std::string& text, const std::string& path) {
  std::vector<EpochSegment> segments;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t colon = item.find(':');
    int64_t world = 0, consumed = -1;
    const bool read =
        colon != std::string::npos &&
        std::from_chars(item.data(), item.data() + colon, world).ptr == item.data() + colon &&
        std::from_chars(item.data() + colon + 1, item.data() + item.size(), consumed).ptr == item.data() + item.size();
    if (!read || world < 1 || world > (1 << 20) || consumed < 0) {
      throw IoError(fmt::format("checkpoint {}: \"{}\" should be WORLD:ITEMS pairs, found '{}'; {}", path,
                                kEarlierSegmentsKey, text, kFreshStartHint));
    }
    segments.push_back({static_cast<int>(world), consumed});
    at = comma + 1;
  }
  if (segments.size() > kMaxEarlierSegments) {
    throw IoError(fmt::format("checkpoint {}: {} earlier worlds in one epoch, more than the {} a resume carries; {}",
                              path, segments.size(), kMaxEarlierSegments, kFreshStartHint));
  }
  return segments;
}

int64_t parse_count(const SafetensorsMetadata& metadata, const char* key, const std::string& path) {
  const std::string& text = required(metadata, key, path);
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    throw IoError(fmt::format("checkpoint {}: \"{}\" should be an integer >= 0, found '{}'; {}", path, key, text,
                              kFreshStartHint));
  }
  return value;
}

double parse_real(const SafetensorsMetadata& metadata, const char* key, const std::string& path) {
  const std::string& text = required(metadata, key, path);
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno != 0) {
    throw IoError(fmt::format("checkpoint {}: \"{}\" should be a number, found '{}'; {}", path, key, text,
                              kFreshStartHint));
  }
  return value;
}

// Items added to the run configuration after checkpoints already existed, with the
// value that a checkpoint without them was written under.
const std::map<std::string, std::string>& unrecorded_defaults() {
  static const std::map<std::string, std::string> defaults = {{"--amp", "off"},
                                                              {"--loss-scale", "none"},
                                                              {"--grad-compression", "none"},
                                                              {"--loss-scale-growth-interval", "2000"},
                                                              {"--shuffle-order", "mtrain"},
                                                              {"--drop-last", "off"},
                                                              {"--random-resized-crop", "unset"},
                                                              {"--center-crop", "unset"},
                                                              {"--shuffle-buffer", "1000"},
                                                              {"--full-decode", "off"},
                                                              {"--synthetic-shape", "1x28x28"}};
  return defaults;
}

// Items added later that have no value to assume for an older checkpoint: unchecked
// when the file does not record them.
const std::set<std::string>& unchecked_when_unrecorded() {
  static const std::set<std::string> items = {"training set fingerprint"};
  return items;
}

// Every item whose value differs, in `expected`'s order, then items only the file has.
std::vector<std::string> configuration_differences(const SafetensorsMetadata& metadata,
                                                   const RunConfiguration& expected) {
  std::vector<std::string> differences;
  std::set<std::string> known;
  for (const auto& [name, value] : expected) {
    known.insert(name);
    const auto it = metadata.find(kConfigPrefix + name);
    if (it == metadata.end()) {
      const auto implied = unrecorded_defaults().find(name);
      if (implied != unrecorded_defaults().end() && implied->second == value) continue;
      if (unchecked_when_unrecorded().count(name) != 0) continue;
      differences.push_back(fmt::format("{} is {} here, unrecorded in the checkpoint", name, value));
    } else if (it->second != value) {
      differences.push_back(fmt::format("{} is {} here, {} in the checkpoint", name, value, it->second));
    }
  }
  const std::string prefix = kConfigPrefix;
  for (const auto& [key, value] : metadata) {
    if (key.rfind(prefix, 0) != 0) continue;
    const std::string name = key.substr(prefix.size());
    if (known.count(name) == 0 && name != kLegacyWorldSizeItem) {
      differences.push_back(fmt::format("{} is {} in the checkpoint, not a setting that must match here", name,
                                        value));
    }
  }
  return differences;
}

}  // namespace

std::string checkpoint_path(const std::string& dir) {
  return (std::filesystem::path(dir) / kCheckpointFileName).string();
}

std::string previous_checkpoint_path(const std::string& dir) {
  return (std::filesystem::path(dir) / kPreviousCheckpointFileName).string();
}

std::string incoming_checkpoint_path(const std::string& dir) {
  return (std::filesystem::path(dir) / kIncomingCheckpointFileName).string();
}

std::string damaged_checkpoint_path(const std::string& dir) {
  return (std::filesystem::path(dir) / kDamagedCheckpointFileName).string();
}

void save_training_checkpoint(const std::string& path, models::Module& model, models::Sgd& optimizer,
                              const TrainPosition& position, const RunConfiguration& configuration) {
  NamedTensors tensors = model_state(model);
  const auto params = model.parameters();
  const std::vector<Tensor>& momentum = optimizer.momentum_buffers();
  MTRAIN_CHECK(momentum.size() == params.size(), "optimizer holds {} momentum buffers for {} parameters",
               momentum.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (momentum[i].defined()) tensors.emplace_back(kMomentumPrefix + params[i].name, momentum[i]);
  }
  SafetensorsMetadata metadata = {{kCheckpointVersionKey, std::string(kCheckpointVersion)},
                                  {kEpochFinishedKey, std::string(position.epoch_finished ? "1" : "0")}};
  metadata[kEpochKey] = std::to_string(position.epoch);
  metadata[kStepsInEpochKey] = std::to_string(position.steps_in_epoch);
  metadata[kTotalStepsKey] = std::to_string(position.total_steps);
  // Shortest text that reads back to the same double.
  metadata[kLossSumKey] = fmt::format("{}", position.loss_sum);
  metadata[kCorrectKey] = std::to_string(position.correct);
  metadata[kImagesKey] = std::to_string(position.images);
  metadata[kTrainSecondsKey] = fmt::format("{}", position.train_seconds);
  metadata[kWorldSizeKey] = std::to_string(position.world_size);
  metadata[kEpochConsumedKey] = std::to_string(position.epoch_consumed);
  if (!position.earlier_segments.empty()) {
    std::string segments;
    for (const EpochSegment& s : position.earlier_segments) {
      segments += fmt::format("{}{}:{}", segments.empty() ? "" : ",", s.world_size, s.consumed);
    }
    metadata[kEarlierSegmentsKey] = segments;
  }
  if (position.loss_scaler.scale > 0.0) {
    metadata[kLossScaleKey] = fmt::format("{}", position.loss_scaler.scale);
    metadata[kLossScaleGoodStepsKey] = std::to_string(position.loss_scaler.good_steps);
    metadata[kSkippedStepsKey] = std::to_string(position.loss_scaler.skipped_steps);
    metadata[kConsecutiveSkipsKey] = std::to_string(position.loss_scaler.consecutive_skips);
  }
  for (const auto& [name, value] : configuration) metadata[kConfigPrefix + name] = value;
  for (const auto& [name, value] : configuration) {
    if (name == "--model") metadata[kWeightsModelKey] = value;
  }
  save_safetensors(path, on_host(tensors), metadata);
}

TrainPosition load_training_checkpoint(const std::string& path, models::Module& model, models::Sgd& optimizer,
                                       const RunConfiguration& expected) {
  SafetensorsFile file;
  try {
    file = load_safetensors(path);
  } catch (const IoError& e) {
    throw IoError(fmt::format("cannot resume from the checkpoint: {}; {}", e.what(), kFreshStartHint));
  }
  const SafetensorsMetadata& metadata = file.metadata;
  if (metadata.count(kSafetensorsChecksumKey) == 0) {
    throw IoError(fmt::format("{} carries no mtrain checksum, so it was not written as a checkpoint by mtrain; {}",
                              path, kFreshStartHint));
  }
  const auto version = metadata.find(kCheckpointVersionKey);
  if (version == metadata.end()) {
    throw IoError(fmt::format("{} is not a training checkpoint (no \"{}\" in its metadata: a weights file from "
                              "--save-final? use it with --init-from instead); {}",
                              path, kCheckpointVersionKey, kFreshStartHint));
  }
  if (version->second != kCheckpointVersion) {
    throw IoError(fmt::format("checkpoint {} has format version {}, this mtrain-train reads version {}; {}", path,
                              version->second, kCheckpointVersion, kFreshStartHint));
  }
  if (const auto differences = configuration_differences(metadata, expected); !differences.empty()) {
    throw InvalidArgument(fmt::format(
        "checkpoint {} was written by a different training configuration: {}; rerun with the checkpoint's "
        "settings to resume it, or {}",
        path, fmt::join(differences, "; "), kFreshStartHint));
  }

  TrainPosition position;
  position.epoch = parse_count(metadata, kEpochKey, path);
  position.steps_in_epoch = parse_count(metadata, kStepsInEpochKey, path);
  position.total_steps = parse_count(metadata, kTotalStepsKey, path);
  const std::string& finished = required(metadata, kEpochFinishedKey, path);
  if (finished != "0" && finished != "1") {
    throw IoError(fmt::format("checkpoint {}: \"{}\" should be 0 or 1, found '{}'; {}", path, kEpochFinishedKey,
                              finished, kFreshStartHint));
  }
  position.epoch_finished = finished == "1";
  position.loss_sum = parse_real(metadata, kLossSumKey, path);
  position.correct = parse_count(metadata, kCorrectKey, path);
  position.images = parse_count(metadata, kImagesKey, path);
  position.train_seconds = parse_real(metadata, kTrainSecondsKey, path);
  const std::string legacy_world = kConfigPrefix + std::string(kLegacyWorldSizeItem);
  position.world_size = static_cast<int>(parse_count(
      metadata, metadata.count(kWorldSizeKey) != 0 ? kWorldSizeKey : legacy_world.c_str(), path));
  position.epoch_consumed = metadata.count(kEpochConsumedKey) != 0 ? parse_count(metadata, kEpochConsumedKey, path) : -1;
  if (position.world_size < 1) {
    throw IoError(fmt::format("checkpoint {}: a world of {} ranks is impossible; {}", path, position.world_size,
                              kFreshStartHint));
  }
  if (const auto it = metadata.find(kEarlierSegmentsKey); it != metadata.end()) {
    position.earlier_segments = parse_segments(it->second, path);
  }
  for (const auto& [key, value] : {std::pair{kLossSumKey, position.loss_sum}, std::pair{kTrainSecondsKey, position.train_seconds}}) {
    if (!(std::isfinite(value) && value >= 0.0)) {
      throw IoError(fmt::format("checkpoint {}: \"{}\" should be a finite number >= 0, found {}; {}", path, key,
                                value, kFreshStartHint));
    }
  }
  if (position.correct > position.images) {
    throw IoError(fmt::format("checkpoint {}: {} images counted correct of {} is impossible; {}", path,
                              position.correct, position.images, kFreshStartHint));
  }
  if (metadata.count(kLossScaleKey) != 0) {
    position.loss_scaler.scale = parse_real(metadata, kLossScaleKey, path);
    position.loss_scaler.good_steps = parse_count(metadata, kLossScaleGoodStepsKey, path);
    position.loss_scaler.skipped_steps = parse_count(metadata, kSkippedStepsKey, path);
    if (metadata.count(kConsecutiveSkipsKey) != 0) {
      position.loss_scaler.consecutive_skips = parse_count(metadata, kConsecutiveSkipsKey, path);
    }
    if (position.loss_scaler.consecutive_skips > position.loss_scaler.skipped_steps) {
      throw IoError(fmt::format("checkpoint {}: {} steps skipped in a row of {} skipped in all is impossible; {}",
                                path, position.loss_scaler.consecutive_skips, position.loss_scaler.skipped_steps,
                                kFreshStartHint));
    }
    if (!(position.loss_scaler.scale > 0.0) || !std::isfinite(position.loss_scaler.scale)) {
      throw IoError(fmt::format("checkpoint {}: \"{}\" should be a finite number > 0, found {}; {}", path,
                                kLossScaleKey, position.loss_scaler.scale, kFreshStartHint));
    }
  }
  if (position.epoch < 1 || position.steps_in_epoch > position.total_steps) {
    throw IoError(fmt::format("checkpoint {}: position epoch {}, {} steps in it, {} in total is impossible; {}",
                              path, position.epoch, position.steps_in_epoch, position.total_steps,
                              kFreshStartHint));
  }

  // Momentum buffers: all or none, and all once SGD with momentum has taken a step.
  const auto params = model.parameters();
  std::vector<Tensor> momentum(params.size());
  NamedTensors destinations = model_state(model);
  size_t present = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string name = kMomentumPrefix + params[i].name;
    if (!file.find(name).defined()) continue;
    // Beside its parameter, wherever the model lives (the file is read on the host).
    const Tensor& value = params[i].param->value;
    momentum[i] = Tensor::empty(value.shape(), value.dtype(), value.device());
    destinations.emplace_back(name, momentum[i]);
    ++present;
  }
  // Steps the loss scaler skipped never reached the optimizer, which makes its momentum
  // buffers at its first applied step.
  const bool needs_momentum = optimizer.options().momentum != 0.0f &&
                              position.total_steps > position.loss_scaler.skipped_steps;
  if ((present != 0 && present != params.size()) || (needs_momentum && present == 0)) {
    throw IoError(fmt::format("checkpoint {} holds momentum buffers for {} of the {} parameters after {} steps "
                              "with momentum {}; expected {}; {}",
                              path, present, params.size(), position.total_steps, optimizer.options().momentum,
                              needs_momentum ? "all of them" : "all or none", kFreshStartHint));
  }
  load_state_into(file, destinations, path);
  optimizer.momentum_buffers() = std::move(momentum);
  return position;
}

}  // namespace mtrain
