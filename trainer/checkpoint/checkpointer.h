// Checkpoints across ranks (--checkpoint-dir): only rank 0 reads and writes the file, and the
// other ranks learn from it what it found and whether it worked (Note [One reader, one writer] in
// checkpointer.cpp), so every rank resumes, goes on or fails together. Collective members must be
// called by every rank, in the same order, from the training thread.
#pragma once

#include <optional>
#include <exception>
#include <string>

#include "collectives/process_group.h"
#include "models/module.h"
#include "models/optim.h"
#include "trainer/loop/train_loop.h"
#include "trainer/checkpoint/checkpoint_file.h"

namespace mtrain {

// Collective over `group` (nothing to share when it is null): makes rank 0's outcome
// every rank's. When `failure` (rank 0's) is set, every rank throws an exception of its
// kind (InvalidArgument, IoError, else InternalError) with its message, so whichever
// rank the launcher hears from first, its root cause names the real reason (as Note
// [Consensus by hashes] has every rank raise the same message). Rank 0 rethrows the
// original. For work only rank 0 does: checkpoints, final weights.
void share_outcome(ProcessGroup* group, int rank, std::exception_ptr failure);

class Checkpointer {
 public:
  // `group` is null in a world of one; `control` carries the host values and defaults
  // to `group`. Everything must outlive the checkpointer.
  Checkpointer(std::string dir, ProcessGroup* group, int rank, models::Module& model, models::Sgd& optimizer,
               RunConfiguration configuration, ProcessGroup* control = nullptr);

  const std::string& path() const { return path_; }
  // The file resume() loaded on rank 0 (the latest or the previous checkpoint); empty
  // before, elsewhere, or when there was none.
  const std::string& resumed_from() const { return resumed_from_; }

  // Collective. Rank 0 creates the directory when needed and loads the checkpoint if
  // there is one; every rank then holds its model state and momentum buffers. Returns
  // the position to start from (with the epoch's totals so far on rank 0 only, Note
  // [Resuming mid-epoch]), or nullopt when there is no checkpoint. Throws what
  // load_training_checkpoint throws, on every rank (Note [One reader, one writer]).
  std::optional<TrainPosition> resume();

  // Collective. Sums the epoch's totals over the ranks, then rank 0 writes the
  // checkpoint; throws rank 0's IoError on every rank when the write failed.
  void save(const TrainPosition& position, CheckpointReason reason);

 private:
  // Rank 0: the latest checkpoint that passes its checks, or the previous one (Note [The
  // previous checkpoint]); nullopt when there is none.
  std::optional<TrainPosition> load_latest_good();
  TrainPosition load_from(const std::string& file);
  // Moves a checkpoint that failed its checks to checkpoint.damaged.safetensors.
  void set_aside_damaged(const std::string& file);
  // Rank 0's save: the new file in place and checked, the latest moved or set aside.
  void write_and_rotate(const TrainPosition& position);

  std::string dir_;
  std::string path_;
  ProcessGroup* group_;
  ProcessGroup* control_;
  int rank_;
  models::Module& model_;
  models::Sgd& optimizer_;
  RunConfiguration configuration_;
  std::string resumed_from_;
  // The file at path_ passed its checks in this run (resumed from, or written by it).
  bool latest_checked_ = false;
};

}  // namespace mtrain
