// --trace DIR for one training run: starts the process's recorder (core/trace.h), takes the
// clock readings that align the ranks, and at the end writes DIR/rank-R.json; rank 0 then merges
// every rank's file into DIR/trace.json when they all reached DIR (one host, or a shared file
// system), and otherwise says how to merge them with mtrain-trace. A trace that cannot be written
// is a warning: the timeline must not cost the run.
#pragma once

#include <string>

#include "core/trace.h"
#include "trainer/setup/start_up.h"

namespace mtrain {

class RunTrace {
 public:
  // Does nothing without --trace. Otherwise a collective on the run's control group (the
  // clock readings): every rank constructs it at the same point, and takes part even when its
  // directory cannot be made (it then records nothing and says so).
  RunTrace(const TrainOptions& options, const TrainingRun& run);

  // After training on every rank (a collective, as the constructor): writes this rank's
  // file, then rank 0 merges. Never throws for the trace's own sake.
  void finish(const TrainingRun& run);
  // After a failure: writes this rank's file only (no collective: peers may be gone).
  void write_after_failure(const TrainingRun& run) noexcept;

 private:
  // Writes this rank's file; false (with a warning) when it could not.
  bool write_rank_file(const TrainingRun& run) noexcept;

  std::string dir_;       // empty: no --trace
  bool recording_ = false;  // this rank records (its directory exists)
  trace::ClockSync clock_;
  bool written_ = false;
};

}  // namespace mtrain
