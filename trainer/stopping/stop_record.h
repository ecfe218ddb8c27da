// The record a worker that stopped on a signal leaves for mtrain-launch, so that the
// launcher's report says "stopped on SIGTERM after step N, checkpoint in X" rather
// than counting an exit status of 75 as a crash (docs/launcher.md "Error file").
//
// It goes to the same file as an error record ($MTRAIN_ERROR_FILE, or torchrun's
// $TORCHELASTIC_ERROR_FILE): the launcher reads that file for every worker that did
// not succeed, and an older launcher still shows the message. The extra "stopped"
// object is what tells the two apart:
//   {"rank": 1, "host": "n1", "message": "received SIGTERM: stopped after step 7 ...",
//    "timestamp": 1.7e9,
//    "stopped": {"signal": "SIGTERM", "signal_rank": 1, "epoch": 1, "step": 7,
//                "checkpoint": "/ckpt/checkpoint.safetensors"}}     ("" without one)
// and "during_startup": true in "stopped" for a worker stopped before its first step.
#pragma once

#include <cstdint>
#include <string>

namespace mtrain {

struct StopRecord {
  int rank = 0;
  std::string message;
  std::string signal;    // "SIGTERM"
  int signal_rank = 0;   // a rank that received it
  int64_t epoch = 0;
  int64_t step = 0;      // the last optimizer step done, counted over the run
  std::string checkpoint;  // path of the checkpoint written at that step, or empty
  // Stopped before its first step (Note [A stop signal during start-up] in
  // stop_signals.h): `checkpoint` is the one the run would resume from, if any, and
  // epoch and step are its position (0 when it had not been read yet).
  bool during_startup = false;
};

// Writes `record` when either variable names a file; does nothing otherwise. Never
// throws (a failure to write is reported on stderr): the run has stopped cleanly and
// its exit status must still say so.
void write_stop_record(const StopRecord& record) noexcept;

}  // namespace mtrain
