// mtrain-train: trains one model replica. See docs/training.md.
#include <csignal>
#include <cstdio>
#include <exception>

#include "core/main_guard.h"
#include "trainer/stopping/error_file.h"
#ifdef MTRAIN_HAVE_MPI
#include "collectives/mpi/mpi_process_group.h"
#endif
#include "trainer/options.h"
#include "trainer/train_command.h"

int main(int argc, char** argv) {
  const int code = mtrain::run_main("mtrain-train", [&] {
    try {
      // A write to a peer (or a launcher) that is gone must be an error the code reports,
      // EPIPE with the operation that failed, not a silent death by SIGPIPE.
      if (std::signal(SIGPIPE, SIG_IGN) == SIG_ERR) {
        throw mtrain::InternalError("cannot ignore SIGPIPE (signal() failed)");
      }
      const auto parsed = mtrain::parse_train_command_line(argc, argv, mtrain::train_choices());
      if (parsed.help) {
        std::fputs(parsed.help_text.c_str(), stdout);
        return 0;
      }
      return mtrain::run_train_command(parsed.options);
    } catch (const mtrain::InvalidArgument& e) {
      // Bad input and bad files fail the same way on every attempt: the launcher spends
      // no restart on them (Note [Errors that will repeat] in launcher/agent.cpp).
      mtrain::write_error_record(e.what(), {{"will_repeat", true}});
      throw;
    } catch (const mtrain::IoError& e) {
      mtrain::write_error_record(e.what(), {{"will_repeat", true}});
      throw;
    } catch (const std::exception& e) {
      mtrain::write_error_record(e.what());
      throw;
    }
  });
#ifdef MTRAIN_HAVE_MPI
  // Note [A failing rank under mpirun]. A stop the ranks agreed on (75) finalises normally.
  if (code != 0 && code != mtrain::kStoppedExitCode) mtrain::abort_mpi_job_on_error("mtrain-train", code);
#endif
  return code;
}
