// run_main(fn): the one place where exceptions become "program: message" on stderr
// and a non-zero exit status (2 for bad input, 1 for everything else).
#pragma once

#include <cstdio>
#include <exception>

#include "core/error.h"

namespace mtrain {

// Exit status of a worker that stopped on a signal after finishing a step (and
// writing its checkpoint when --checkpoint-dir is set). 75 is EX_TEMPFAIL from
// sysexits.h, "try again later": the run is not finished, so it must not read as a
// success (0), and it is not a crash (1, 2, or 128 + signal). mtrain-train exits with
// it (Note [Stopping on a signal]); mtrain-launch recognises it, with the worker's stop
// record, and exits with it too, so a batch script can requeue on 75:
// `[ $? -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"`.
inline constexpr int kStoppedExitCode = 75;

template <class Fn>
int run_main(const char* program, Fn&& fn) {
  try {
    return fn();
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 1;
  }
}

}  // namespace mtrain
