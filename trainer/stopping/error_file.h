// The records a worker leaves for its launcher in $MTRAIN_ERROR_FILE (or torchrun's
// $TORCHELASTIC_ERROR_FILE), which mtrain-launch reads for every worker that did not
// succeed (docs/launcher.md "Error file"):
//   - an error record, written by a worker that knows why it is dying, so the launcher
//     names the root cause rather than the ranks that died of it:
//       {"rank": 1, "host": "n1", "message": "...", "timestamp": 1.7e9}
//   - a stop record, written by a worker that stopped cleanly on a signal, so the report
//     says "stopped on SIGTERM after step N, checkpoint in X" rather than counting exit
//     status 75 as a crash. It is an error record with a "stopped" object (an older
//     launcher still shows the message):
//       "stopped": {"signal": "SIGTERM", "signal_rank": 1, "epoch": 1, "step": 7,
//                   "checkpoint": "/ckpt/checkpoint.safetensors"}   ("" without one)
//     with "during_startup": true for a worker stopped before its first step.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace mtrain {

// Writes the record when either variable names a file; does nothing otherwise. The
// members of `extra` are added to it (and replace the defaults of the same name, e.g.
// "rank"). Never throws: it runs while an error is already on its way out, and a
// failure to write the record must not hide that error (it is reported on stderr
// instead).
void write_error_record(const std::string& message,
                        const nlohmann::json& extra = nlohmann::json::object()) noexcept;

struct StopRecord {
  int rank = 0;
  std::string message;
  std::string signal;    // "SIGTERM"
  int signal_rank = 0;   // a rank that received it
  int64_t epoch = 0;
  int64_t step = 0;      // the last optimizer step done, counted over the run
  std::string checkpoint;  // path of the checkpoint written at that step, or empty
  // Stopped before its first step (Note [A stop signal during start-up] in
  // stop_signals.cpp): `checkpoint` is the one the run would resume from, if any, and
  // epoch and step are its position (0 when it had not been read yet).
  bool during_startup = false;
};

// Writes `record` when either variable names a file; does nothing otherwise. Never
// throws (a failure to write is reported on stderr): the run has stopped cleanly and
// its exit status must still say so.
void write_stop_record(const StopRecord& record) noexcept;

}  // namespace mtrain
