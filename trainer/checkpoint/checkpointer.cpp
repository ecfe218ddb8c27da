#include "trainer/checkpoint/checkpointer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>

#include "core/error.h"
#include "trainer/ddp/rank_consensus.h"

namespace mtrain {

namespace {

// A save killed before it moved its new checkpoint into place (SIGKILL after the
// launcher's --term_timeout, a node lost) leaves `.checkpoint.incoming.safetensors.tmp-PID-N`
// or checkpoint.incoming.safetensors behind, as large as a checkpoint; every such run would
// add one. Rank 0, the only writer, removes them before it saves again. Failing to remove
// one is only worth a warning.
void remove_interrupted_saves(const std::string& dir) {
  // Temporary files of the incoming checkpoint (and of the latest, which earlier versions
  // wrote directly), and the incoming file itself (a save killed between writing it and
  // moving it into place; Note [The previous checkpoint]).
  const std::string prefixes[] = {temporary_file_prefix(incoming_checkpoint_path(dir)),
                                  temporary_file_prefix(checkpoint_path(dir))};
  const std::string incoming = std::filesystem::path(incoming_checkpoint_path(dir)).filename().string();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool leftover = name == incoming || std::any_of(std::begin(prefixes), std::end(prefixes), [&](const auto& p) {
                            return name.rfind(p, 0) == 0;
                          });
    if (!leftover) continue;
    std::error_code removed;
    std::filesystem::remove(entry.path(), removed);
    if (removed) {
      spdlog::warn("--checkpoint-dir {}: cannot remove {}, left by an interrupted save: {}", dir, name,
                   removed.message());
    } else {
      spdlog::info("removed {}, left in --checkpoint-dir by an interrupted save", name);
    }
  }
}

// The resume header: whether rank 0 found a checkpoint, the position's counters (the
// world that wrote it among them: every rank must shard the epoch's rest alike) and
// whether momentum buffers follow.
// The loss scale travels as the bits of its double: every rank must unscale the reduced
// gradients by the same factor (Note [Dynamic loss scaling]).
enum HeaderField {
  kFound,
  kEpoch,
  kStepsInEpoch,
  kTotalSteps,
  kEpochFinished,
  kHasMomentum,
  kLossScaleBits,
  kLossScaleGoodSteps,
  kSkippedSteps,
  kConsecutiveSkips,
  kWorldSize,
  kEpochConsumed,
  kSegmentCount,
  kSegments,  // kMaxEarlierSegments (world, consumed) pairs
  kHeaderSize = kSegments + 2 * kMaxEarlierSegments
};

const char* reason_name(CheckpointReason reason) {
  switch (reason) {
    case CheckpointReason::kEvery: return "--checkpoint-every";
    case CheckpointReason::kEpochEnd: return "end of epoch";
    case CheckpointReason::kStop: return "stop signal";
  }
  return "?";
}

// How rank 0's operation ended, as broadcast by share_outcome.
enum OutcomeKind : int64_t { kSucceeded = 0, kInvalidArgument = 1, kIoError = 2, kOtherError = 3 };

}  // namespace

void share_outcome(ProcessGroup* group, int rank, std::exception_ptr failure) {
  if (group == nullptr) {
    if (failure) std::rethrow_exception(failure);
    return;
  }
  std::string message;
  Tensor header = Tensor::zeros({2}, DType::Int64);
  if (rank == 0 && failure) {
    int64_t kind = kOtherError;
    try {
      std::rethrow_exception(failure);
    } catch (const InvalidArgument& e) {
      kind = kInvalidArgument;
      message = e.what();
    } catch (const IoError& e) {
      kind = kIoError;
      message = e.what();
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
      message = "unknown error";
    }
    header.data<int64_t>()[0] = kind;
    header.data<int64_t>()[1] = static_cast<int64_t>(message.size());
  }
  group->broadcast(header, 0)->wait();
  const int64_t kind = header.data<int64_t>()[0];
  if (kind == kSucceeded) return;
  // The text travels as int64 words, the one integer type every backend broadcasts.
  const int64_t length = header.data<int64_t>()[1];
  Tensor words = Tensor::zeros({(length + 7) / 8}, DType::Int64);
  if (rank == 0) std::memcpy(words.raw_data(), message.data(), message.size());
  group->broadcast(words, 0)->wait();
  if (rank == 0) std::rethrow_exception(failure);
  message.assign(static_cast<const char*>(words.raw_data()), static_cast<size_t>(length));
  message = fmt::format("rank 0: {}", message);
  if (kind == kInvalidArgument) throw InvalidArgument(message);
  if (kind == kIoError) throw IoError(message);
  throw InternalError(message);
}

// Note [The previous checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One damaged file (a disk error, a copy cut short, a bit flipped in storage) must not
// mean starting over from step 0, nor cost the good checkpoint beside it. Rank 0 keeps
// two: checkpoint.safetensors (the latest) and checkpoint.previous.safetensors (the one
// before). A save writes the new checkpoint as checkpoint.incoming.safetensors (itself
// atomic: temporary file, fsync, rename), reads it back and checks it, and only then
// moves the latest into the previous slot and the new one into the latest's, each rename
// made durable: every moment leaves the last good checkpoint in a slot a resume reads,
// and a save killed midway leaves at most an incoming file, which the next start removes.
// A file known to be damaged never moves into the previous slot: a resume whose latest
// fails its checks (IoError: truncated, corrupt, not a checkpoint) resumes the previous
// one and sets the damaged file aside as checkpoint.damaged.safetensors (replacing an
// older one), saying so; and a save first checks a latest that this run neither resumed
// from nor wrote. A configuration that differs (InvalidArgument) is the user's to fix and
// is never bypassed.

// Whether `path` is certainly absent. Only then is it skipped: one that cannot be looked
// at (EACCES, EIO, a symlink loop) would be overwritten by the first save.
static bool certainly_absent(const std::string& dir, const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::symlink_status(path, ec);
  if (ec && status.type() != std::filesystem::file_type::not_found) {
    throw IoError(fmt::format("--checkpoint-dir {}: cannot check for {}: {}", dir, path, ec.message()));
  }
  return status.type() == std::filesystem::file_type::not_found;
}

std::optional<TrainPosition> Checkpointer::load_latest_good() {
  const std::string previous = previous_checkpoint_path(dir_);
  const bool have_previous = !certainly_absent(dir_, previous);
  if (certainly_absent(dir_, path_)) {
    if (!have_previous) return std::nullopt;
    spdlog::warn("--checkpoint-dir {}: no {} (a save was interrupted), resuming the previous checkpoint {}", dir_,
                 path_, previous);
    return load_from(previous);
  }
  try {
    return load_from(path_);
  } catch (const IoError& latest) {
    if (!have_previous) throw;
    std::optional<TrainPosition> position;
    try {
      position = load_from(previous);
    } catch (const IoError& older) {
      throw IoError(fmt::format("{}; the previous checkpoint cannot be resumed either: {}", latest.what(),
                                older.what()));
    }
    spdlog::warn("{}; resuming the previous checkpoint {} instead (the steps since it are trained again)",
                 latest.what(), previous);
    set_aside_damaged(path_);
    return position;
  }
}

TrainPosition Checkpointer::load_from(const std::string& file) {
  TrainPosition position = load_training_checkpoint(file, model_, optimizer_, configuration_);
  resumed_from_ = file;
  latest_checked_ = file == path_;
  return position;
}

void Checkpointer::set_aside_damaged(const std::string& file) {
  const std::string damaged = damaged_checkpoint_path(dir_);
  rename_durably(file, damaged);
  spdlog::warn("--checkpoint-dir {}: the damaged {} is kept as {}, where no resume reads it", dir_, file, damaged);
}

// Note [The previous checkpoint]: the new checkpoint is in place and checked before the
// latest moves, and a latest that fails its checks is set aside rather than moved.
void Checkpointer::write_and_rotate(const TrainPosition& p) {
  const std::string incoming = incoming_checkpoint_path(dir_);
  save_training_checkpoint(incoming, model_, optimizer_, p, configuration_);
  load_safetensors(incoming);  // reads it back whole: checksum, header, every tensor's bytes
  if (!certainly_absent(dir_, path_)) {
    bool good = latest_checked_;
    if (!good) {
      try {
        load_safetensors(path_);
        good = true;
      } catch (const IoError& e) {
        spdlog::warn("{}", e.what());
      }
    }
    if (good) {
      rename_durably(path_, previous_checkpoint_path(dir_));
    } else {
      set_aside_damaged(path_);
    }
  }
  rename_durably(incoming, path_);
  latest_checked_ = true;
}

// Note [One reader, one writer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Only rank 0 touches the checkpoint file. Writing: the replicas are identical after every step
// (the Reducer averages gradients and SGD is deterministic), so rank 0's model and momentum are
// everyone's; rank 0 writes, then broadcasts whether it worked, so every rank fails (or goes on)
// together instead of some waiting in a collective for a rank that died of a full disk. Resuming:
// rank 0 reads and checks the file and broadcasts what it found (a header with the position, then
// the model state and the momentum buffers), rather than every rank reading it, because
//   - the ranks must agree on whether a checkpoint exists at all: with NFS attribute caching one
//     node can still see the file another has not, and half a gang resuming while the other half
//     starts afresh is the silent mix to avoid;
//   - the file need only be visible to rank 0's node, and a thousand ranks do not read the same
//     file at once from a shared filesystem;
//   - a file that fails its checks fails on one rank; it broadcasts the error's kind and message
//     (share_outcome), and every rank stops with the same error, so the launcher's root cause
//     names the reason whichever rank it hears from first.
// It works the same over every backend (Gloo, MPI without a store, NCCL), and in a world of one
// there is nothing to broadcast. The header, the outcome and the epoch totals are host values and
// travel on the control group; the model state and the momentum buffers live on the training
// device and travel on the gradient group (Note [Control-plane collectives] in
// training_groups.cpp). Rank 0 copies device tensors to the host to write them and reads the file
// into them with host-to-device copies.
Checkpointer::Checkpointer(std::string dir, ProcessGroup* group, int rank, models::Module& model,
                           models::Sgd& optimizer, RunConfiguration configuration, ProcessGroup* control)
    : dir_(std::move(dir)),
      path_(checkpoint_path(dir_)),
      group_(group),
      control_(control != nullptr ? control : group),
      rank_(rank),
      model_(model),
      optimizer_(optimizer),
      configuration_(std::move(configuration)) {}

std::optional<TrainPosition> Checkpointer::resume() {
  Tensor header = Tensor::zeros({kHeaderSize}, DType::Int64);
  std::optional<TrainPosition> position;
  std::exception_ptr failure;
  if (rank_ == 0) {
    try {
      std::error_code ec;
      std::filesystem::create_directories(dir_, ec);
      if (ec) throw IoError(fmt::format("--checkpoint-dir {}: cannot create it: {}", dir_, ec.message()));
      remove_interrupted_saves(dir_);
      position = load_latest_good();
    } catch (...) {
      failure = std::current_exception();
    }
    int64_t* h = header.data<int64_t>();
    h[kFound] = position ? 1 : 0;
    if (position) {
      h[kEpoch] = position->epoch;
      h[kStepsInEpoch] = position->steps_in_epoch;
      h[kTotalSteps] = position->total_steps;
      h[kEpochFinished] = position->epoch_finished ? 1 : 0;
      h[kHasMomentum] = optimizer_.momentum_buffers().empty() || !optimizer_.momentum_buffers()[0].defined() ? 0 : 1;
      std::memcpy(&h[kLossScaleBits], &position->loss_scaler.scale, sizeof(double));
      h[kLossScaleGoodSteps] = position->loss_scaler.good_steps;
      h[kSkippedSteps] = position->loss_scaler.skipped_steps;
      h[kConsecutiveSkips] = position->loss_scaler.consecutive_skips;
      h[kWorldSize] = position->world_size;
      h[kEpochConsumed] = position->epoch_consumed;
      h[kSegmentCount] = static_cast<int64_t>(position->earlier_segments.size());
      for (size_t k = 0; k < position->earlier_segments.size(); ++k) {
        h[kSegments + 2 * k] = position->earlier_segments[k].world_size;
        h[kSegments + 2 * k + 1] = position->earlier_segments[k].consumed;
      }
    }
  }
  share_outcome(control_, rank_, failure);
  if (group_ == nullptr) return position;
  control_->broadcast(header, 0)->wait();
  const int64_t* h = header.data<int64_t>();
  if (h[kFound] == 0) {
    // Only rank 0 reads the directory, so a rank on another node may see a checkpoint
    // that rank 0 does not (node-local storage, a requeue that moved rank 0): say so
    // instead of starting afresh without a word.
    std::error_code ec;
    if (rank_ != 0 && std::filesystem::exists(path_, ec)) {
      spdlog::warn("rank 0 found no checkpoint in --checkpoint-dir {}, but this rank sees {}: the run starts "
                   "afresh. The directory must be one rank 0 sees (shared storage)",
                   dir_, path_);
    }
    return std::nullopt;
  }

  // Rank 0's model and momentum become everyone's.
  broadcast_module_state(*group_, model_);
  if (h[kHasMomentum] != 0) {
    auto params = model_.parameters();
    std::vector<Tensor>& momentum = optimizer_.momentum_buffers();
    for (size_t i = 0; i < params.size(); ++i) {
      const Tensor& value = params[i].param->value;
      if (rank_ != 0) momentum[i] = Tensor::empty(value.shape(), value.dtype(), value.device());
      group_->broadcast(momentum[i], 0)->wait();
    }
  }
  if (rank_ == 0) return position;
  TrainPosition p;  // the epoch's totals stay on rank 0 (Note [Resuming mid-epoch])
  p.epoch = h[kEpoch];
  p.steps_in_epoch = h[kStepsInEpoch];
  p.total_steps = h[kTotalSteps];
  p.epoch_finished = h[kEpochFinished] != 0;
  std::memcpy(&p.loss_scaler.scale, &h[kLossScaleBits], sizeof(double));
  p.loss_scaler.good_steps = h[kLossScaleGoodSteps];
  p.loss_scaler.skipped_steps = h[kSkippedSteps];
  p.loss_scaler.consecutive_skips = h[kConsecutiveSkips];
  p.world_size = static_cast<int>(h[kWorldSize]);
  p.epoch_consumed = h[kEpochConsumed];
  for (int64_t k = 0; k < h[kSegmentCount]; ++k) {
    p.earlier_segments.push_back({static_cast<int>(h[kSegments + 2 * k]), h[kSegments + 2 * k + 1]});
  }
  return p;
}

void Checkpointer::save(const TrainPosition& position, CheckpointReason reason) {
  TrainPosition p = position;
  if (control_ != nullptr && !p.epoch_finished) {
    Tensor counts = Tensor::from_vector<int64_t>({p.correct, p.images}, {2});
    control_->allreduce(counts, ReduceOp::Sum)->wait();
    p.correct = counts.data<int64_t>()[0];
    p.images = counts.data<int64_t>()[1];
    p.loss_sum = sum_over_ranks(*control_, p.loss_sum);
  }
  std::exception_ptr failure;
  if (rank_ == 0) {
    try {
      write_and_rotate(p);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  share_outcome(control_, rank_, failure);
  spdlog::info("checkpoint ({}): step {} (epoch {}) written to {}", reason_name(reason), p.total_steps, p.epoch,
               path_);
}

}  // namespace mtrain
