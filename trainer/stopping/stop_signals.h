// The worker's side of preemption: SIGTERM, SIGINT and SIGUSR1 ask the run to stop
// after the current optimizer step instead of killing it mid-step.
//
// Note [Stopping on a signal]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// SLURM sends SIGTERM at preemption and at the time limit (then SIGKILL KillWait
// seconds later), and SIGUSR1 ahead of time with `--signal=USR1@T`; mtrain-launch
// forwards SIGUSR1/SIGUSR2 and answers SIGTERM/SIGINT by sending SIGTERM to the
// workers. A thread of its own receives them (Note [Signals never interrupt kernels])
// and only records the first such signal (an atomic store); the training loop reads it
// at step boundaries. The ranks agree
// on the step to stop after through the gradient synchronization (Note [Agreeing to
// stop] in gradient_sync.h), write the checkpoint, and exit with kStoppedExitCode.
//
// A second SIGINT or SIGTERM while a stop is pending means "now": that thread restores
// the default action and re-raises, so the process dies of that signal at once (no
// checkpoint for the unfinished step; the previous one is intact, writes are atomic).
// Except within kDuplicateSignalWindow of the first: under SLURM the same SIGTERM
// reaches a worker twice, from slurmstepd (which signals every process of the step)
// and from mtrain-launch forwarding its own copy, and that must not turn a clean stop
// into a kill. SIGUSR1 never forces an exit after the first step: it is a warning, and
// repeats of it are harmless. (Before the first step every stop signal ends the worker:
// Note [A stop signal during start-up].)
//
// Note [Signals never interrupt kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A signal handler runs on the stack of whichever thread the kernel picks, below that
// thread's stack pointer. oneDNN's JIT sgemm kernels (2.x up to 3.11; oneDNN issue
// #4845, fixed by PR #4855) point rsp into the heap while they run, so a stop signal
// that arrived during a linear layer wrote its signal frame over heap memory: a SIGTERM
// to an MLP run ended in "corrupted size vs. prev_size" or a garbage tensor in about
// one run in six. A standalone loop of dnnl_sgemm under a 50 us timer signal reproduces
// it, and goes clean with the handler on an alternate stack. So the stop signals are
// never handled on a computing thread: install_stop_signal_handlers() blocks them in
// the calling thread (main, before it starts any other thread; threads inherit the
// mask) and starts a thread that takes them with sigwait() and does what the handler
// did. The handler stays installed for a thread started earlier, and a forked child
// gets the signals unblocked again. Only process-directed signals reach that thread
// (kill, not raise or pthread_kill aimed at another thread), which is how the
// launcher, SLURM and users send them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/main_guard.h"

namespace mtrain {

// The exit status after such a stop is kStoppedExitCode (core/main_guard.h).

// A repeat of the stop signal within this many nanoseconds of the first is taken for
// a second delivery of the same request (see the Note).
inline constexpr int64_t kDuplicateSignalWindowNs = 1'000'000'000;

enum class StopSignalAction {
  kRequestStop,      // the first stop signal: stop after the current step
  kIgnoreRepeat,     // already stopping; this one adds nothing
  kExitImmediately,  // a second SIGINT/SIGTERM: die of it now
};

// The decision the handler takes for `sig` arriving at `now_ns` when `pending_sig`
// (0: none) arrived at `pending_ns`. Pure, so it is testable and async-signal-safe.
StopSignalAction classify_stop_signal(int pending_sig, int64_t pending_ns, int sig, int64_t now_ns);

// Sets up the handling of SIGTERM, SIGINT and SIGUSR1 (idempotent): blocks them in the
// calling thread and starts the thread that receives them (Note [Signals never
// interrupt kernels]). Call from the main thread before it starts any other thread.
void install_stop_signal_handlers();

// Note [A stop signal during start-up]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Before its first step a worker has no step to finish and nothing new to save, but it
// can wait a long time: for its peers at the rendezvous and in the first collectives
// (up to --timeout), for the store. Recording the signal for "after the step" left a
// job stuck at start-up deaf to the first SIGTERM, so SLURM's preemption of it ended
// in SIGKILL and a user had to send a second signal. So from arm_startup_stop() until
// disarm_startup_stop(), the first stop signal ends the worker at once: the signal
// thread runs the start-up action (the stop record, then a log line), flushes, and
// calls _exit(kStoppedExitCode), without destructors, since the main thread may be
// anywhere (inside Gloo or a store wait). Any checkpoint on disk is untouched, so the
// same command resumes from it, exactly as after a stop at a step boundary. A second
// signal meanwhile stays pending: the exit is a file write and a log line away.
//
// The trainer disarms before anything that calls MPI_Init (the MPI backend, a store
// address broadcast over MPI): ending without MPI_Finalize would make mpirun report a
// crash, so under MPI a stop signal still waits for the first step. It also disarms
// when start-up throws, before the error record is written, so that the two records
// never race for the error file.
//
// Who handles the signal is decided by one compare-exchange on a shared state, after
// the signal is recorded: the signal thread records, then tries armed -> exiting;
// disarm tries armed -> done. Exactly one wins: either the process exits now, or the
// training loop takes the recorded signal at its first step boundary. A signal that
// arrived before arm_startup_stop() is pending when it arms, and arming exits at once.

// Called with the signal just before the process exits with kStoppedExitCode: on the
// signal thread, or on the arming thread when a signal was already pending. Must not
// throw (an exception is caught and ignored).
using StartupStopAction = std::function<void(int sig)>;

// Arms the start-up exit (see the Note). Call after install_stop_signal_handlers().
// Exits with kStoppedExitCode at once if a stop signal is already pending.
void arm_startup_stop(StartupStopAction action);

// Ends start-up: from here on a stop signal stops the run after a step. Idempotent. When
// the signal thread has already begun exiting, this does not return.
void disarm_startup_stop();

// The start-up exit of one worker, armed for the life of the object (arm_startup_stop
// and disarm_startup_stop): a stop signal meanwhile writes a stop record saying how far
// start-up got (the checkpoint a rerun resumes from and its position, once known), logs
// it and exits with kStoppedExitCode. Thread-safe: the record is built on the signal
// thread.
class StartupStop {
 public:
  explicit StartupStop(int rank);
  ~StartupStop();  // disarms
  StartupStop(const StartupStop&) = delete;
  StartupStop& operator=(const StartupStop&) = delete;

  void resumes_from(const std::string& checkpoint);  // the checkpoint a rerun resumes from
  void at_position(int64_t epoch, int64_t step);     // that checkpoint's position, once read
  void disarm();                                     // start-up is over (idempotent)

 private:
  struct Progress;
  std::shared_ptr<Progress> progress_;
};

// The first stop signal received since install_stop_signal_handlers, or 0.
int pending_stop_signal();

// Forgets a pending stop signal (for tests that raise one in-process).
void clear_pending_stop_signal();

// Note [Stop votes]
// ~~~~~~~~~~~~~~~~~
// What each rank contributes to the stop agreement: 0 for "carry on", else the signal
// it received and its rank packed into one int64 so that the largest vote picks the
// highest signal number and, among the ranks that received it, the lowest rank. Every
// rank then names the same signal and rank in its message.
int64_t encode_stop_vote(int sig, int rank);
// Not a signal: the vote of a rank whose loss was not finite. Above every signal number,
// so it wins the all-reduce and every rank raises the divergence (Note [Agreeing to
// diverge] in train_loop.h) instead of waiting in a collective for the rank that did.
inline constexpr int kDivergedVote = 1 << 16;
struct StopVote {
  int signal = 0;  // 0: nobody asked to stop
  int rank = 0;    // a rank that received `signal`
};
StopVote decode_stop_vote(int64_t vote);

// "SIGTERM", "SIGUSR1", ...; "signal N" for others.
std::string stop_signal_name(int sig);

}  // namespace mtrain
