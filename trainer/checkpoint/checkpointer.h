// Checkpoints across ranks: which rank reads and writes the file, and how the others
// learn what it found (--checkpoint-dir).
//
// Note [One reader, one writer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Only rank 0 touches the checkpoint file. Writing: the replicas are identical after
// every step (the Reducer averages gradients and SGD is deterministic), so rank 0's
// model and momentum are everyone's; rank 0 writes, then broadcasts whether it worked,
// so every rank fails (or goes on) together instead of some waiting in a collective
// for a rank that died of a full disk. Resuming: rank 0 reads and checks the file and
// broadcasts what it found (a header with the position, then the model state and the
// momentum buffers), rather than every rank reading it, because
//   - the ranks must agree on whether a checkpoint exists at all: with NFS attribute
//     caching one node can still see the file another has not, and half a gang
//     resuming while the other half starts afresh is the silent mix to avoid;
//   - the file need only be visible to rank 0's node, and a thousand ranks do not read
//     the same file at once from a shared filesystem;
//   - a file that fails its checks fails on one rank; it broadcasts the error's kind
//     and message, and every rank stops with the same error, so the launcher's root
//     cause names the reason whichever rank it hears from first.
// It works the same over every backend (Gloo, MPI without a store, NCCL), and in a
// world of one there is nothing to broadcast. The header, the outcome and the epoch
// totals are host values and travel on the control group; the model state and the
// momentum buffers live on the training device and travel on the gradient group (Note
// [Control-plane collectives] in training_groups.h). Rank 0 copies device tensors to
// the host to write them and reads the file into them with host-to-device copies.
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

  std::string dir_;
  std::string path_;
  ProcessGroup* group_;
  ProcessGroup* control_;
  int rank_;
  models::Module& model_;
  models::Sgd& optimizer_;
  RunConfiguration configuration_;
};

}  // namespace mtrain
