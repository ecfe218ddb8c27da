// The worker's side of preemption: SIGTERM, SIGINT and SIGUSR1 ask the run to stop after the
// current optimizer step instead of killing it mid-step (Note [Stopping on a signal] in
// stop_signals.cpp). A thread of its own receives them, never a computing thread (Note [Signals
// never interrupt kernels]); the loop reads pending_stop_signal() at step boundaries and the ranks
// agree on the step through their stop votes. Before the first step a stop signal ends the worker
// at once (Note [A stop signal during start-up]). A second SIGINT/SIGTERM while a stop is pending
// kills the process, except within kDuplicateSignalWindowNs of the first.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/main_guard.h"

namespace mtrain {

// The exit status after such a stop is kStoppedExitCode (core/main_guard.h).

// A repeat of the stop signal within this many nanoseconds of the first is taken for
// a second delivery of the same request (Note [Stopping on a signal]).
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

// Called with the signal just before the process exits with kStoppedExitCode: on the
// signal thread, or on the arming thread when a signal was already pending. Must not
// throw (an exception is caught and ignored).
using StartupStopAction = std::function<void(int sig)>;

// Arms the start-up exit (Note [A stop signal during start-up]): until disarmed, the first
// stop signal runs `action` and exits with kStoppedExitCode; exits at once if a stop signal
// is already pending. Call after install_stop_signal_handlers().
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

// Called on the signal thread for the first stop signal after start-up, so that the
// request is acknowledged at once rather than when the step ends (it may take
// seconds). A plain function (what it reads must be static, since the signal thread
// may outlive the run); nullptr: no acknowledgement (the default, and after training).
// Returns once no call of the previous one is running.
using StopAcknowledgement = void (*)(int sig);
void set_stop_acknowledgement(StopAcknowledgement acknowledge);

// An acknowledgement for the life of the object (or until clear()), so that none is left
// set on any way out of a run (Note [An acknowledgement never outlives the run]).
class ScopedStopAcknowledgement {
 public:
  explicit ScopedStopAcknowledgement(StopAcknowledgement acknowledge) { set_stop_acknowledgement(acknowledge); }
  ~ScopedStopAcknowledgement() { clear(); }
  ScopedStopAcknowledgement(const ScopedStopAcknowledgement&) = delete;
  ScopedStopAcknowledgement& operator=(const ScopedStopAcknowledgement&) = delete;
  void clear() { set_stop_acknowledgement(nullptr); }
};

// Forgets a pending stop signal (for tests that raise one in-process).
void clear_pending_stop_signal();

// What each rank contributes to the stop agreement (Note [Stop votes]): 0 for "carry on", else
// the signal and the rank packed into one int64, so that the largest vote wins.
int64_t encode_stop_vote(int sig, int rank);
// Not a signal: the vote of a rank whose loss was not finite. Above every signal number,
// so it wins the all-reduce and every rank raises the divergence (Note [Agreeing to
// diverge] in train_loop.cpp) instead of waiting in a collective for the rank that did.
inline constexpr int kDivergedVote = 1 << 16;
struct StopVote {
  int signal = 0;  // 0: nobody asked to stop
  int rank = 0;    // a rank that received `signal`
};
StopVote decode_stop_vote(int64_t vote);

// "SIGTERM", "SIGUSR1", ...; "signal N" for others.
std::string stop_signal_name(int sig);

}  // namespace mtrain
