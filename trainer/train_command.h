// mtrain-train from parsed options to trained (and saved) weights: logging set-up,
// environment and threads, device report, data, model, optimizer, the loop, output.
#pragma once

#include "trainer/options.h"

namespace mtrain {

// The --model and --dataset names mtrain-train accepts.
TrainChoices train_choices();

// Runs one training job; returns the exit status: 0 when it ran to the end,
// kStoppedExitCode (stop_signals.h) when a signal stopped it after a step. Throws
// mtrain::Error subclasses (InvalidArgument for bad input, IoError for files) with
// one-line messages; main turns them into the exit code.
int run_train_command(const TrainOptions& options);

}  // namespace mtrain
