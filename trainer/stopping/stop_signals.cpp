#include "trainer/stopping/stop_signals.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "trainer/stopping/error_file.h"

namespace mtrain {

namespace {

std::atomic<int> g_pending_sig{0};
std::atomic<int64_t> g_pending_ns{0};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "the signal handler needs lock-free atomics");

constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1};

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Note [A stop signal during start-up]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Before its first step a worker has no step to finish and nothing new to save, but it can wait a
// long time: for its peers at the rendezvous and in the first collectives (up to --timeout), for
// the store. Recording the signal for "after the step" would leave a job stuck at start-up deaf to
// the first SIGTERM, so SLURM's preemption would end in SIGKILL. So from arm_startup_stop() until
// disarm_startup_stop(), the first stop signal ends the worker at once: the signal thread runs the
// start-up action (the stop record, then a log line), flushes, and calls _exit(kStoppedExitCode),
// without destructors, since the main thread may be anywhere (inside Gloo or a store wait). Any
// checkpoint on disk is untouched, so the same command resumes from it, exactly as after a stop at
// a step boundary. A second signal meanwhile stays pending: the exit is a file write and a log line
// away.
//
// The trainer disarms before anything that calls MPI_Init (the MPI backend, a store address
// broadcast over MPI): ending without MPI_Finalize would make mpirun report a crash, so under MPI a
// stop signal still waits for the first step. It also disarms when start-up throws, before the
// error record is written, so that the two records never race for the error file.
//
// Who handles the signal is decided by one compare-exchange on a shared state, after the signal is
// recorded: the signal thread records, then tries armed -> exiting; disarm tries armed -> done.
// Exactly one wins: either the process exits now, or the training loop takes the recorded signal
// at its first step boundary. A signal that arrived before arm_startup_stop() is pending when it
// arms, and arming exits at once.
//
// Note [A stop signal during start-up]: the states of the start-up exit.
enum StartupState : int { kNotArmed, kArmed, kExiting, kDone };
std::atomic<int> g_startup{kNotArmed};
StartupStopAction g_startup_action;  // written before arming; run by the CAS winner only
// Note [An acknowledgement never outlives the run]: the signal thread calls it holding the
// mutex, so setting it waits for a call in progress. Both trivially destructible: the
// signal thread may still use them during exit.
std::mutex g_acknowledge_mu;
StopAcknowledgement g_acknowledge = nullptr;

// Runs the start-up action and ends the process. Only for the thread whose
// compare-exchange armed -> exiting succeeded.
[[noreturn]] void exit_during_startup(int sig) {
  try {
    if (g_startup_action) g_startup_action(sig);
  } catch (...) {
  }
  std::fflush(nullptr);
  ::_exit(kStoppedExitCode);
}

bool begin_startup_exit() {
  int armed = kArmed;
  return g_startup.compare_exchange_strong(armed, kExiting);
}

// Note [Stopping on a signal]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// SLURM sends SIGTERM at preemption and at the time limit (then SIGKILL KillWait seconds later),
// and SIGUSR1 ahead of time with `--signal=USR1@T`; mtrain-launch forwards SIGUSR1/SIGUSR2 and
// answers SIGTERM/SIGINT by sending SIGTERM to the workers. The signal thread only records the
// first such signal (an atomic store); the training loop reads it at step boundaries, the ranks
// agree on the step to stop after (Note [Agreeing to stop] in trainer/ddp/step_exchange.cpp), write the
// checkpoint, and exit with kStoppedExitCode.
//
// A second SIGINT or SIGTERM while a stop is pending means "now": the default action is restored
// and the signal re-raised, so the process dies of it at once (no checkpoint for the unfinished
// step; the previous one is intact, writes are atomic). Except within kDuplicateSignalWindowNs of
// the first: under SLURM the same SIGTERM reaches a worker twice, from slurmstepd (which signals
// every process of the step) and from mtrain-launch forwarding its own copy, and that must not turn
// a clean stop into a kill. SIGUSR1 never forces an exit after the first step: it is a warning, and
// repeats of it are harmless.
//
// Records `sig` if it is the first stop signal; returns whether it was. On a second
// SIGINT/SIGTERM, dies of it. Only async-signal-safe calls, because it also serves as
// the fallback handler: atomics, clock_gettime, write, sigaction, pthread_sigmask, raise.
bool record_stop_signal(int sig) {
  const int saved_errno = errno;
  const int64_t now = monotonic_ns();
  int expected = 0;
  if (g_pending_sig.compare_exchange_strong(expected, sig)) {
    g_pending_ns.store(now);
    errno = saved_errno;
    return true;
  }
  if (classify_stop_signal(expected, g_pending_ns.load(), sig, now) == StopSignalAction::kExitImmediately) {
    static const char kMessage[] =
        "mtrain-train: a second stop signal while stopping: exiting now, without finishing the step\n";
    ssize_t ignored = ::write(STDERR_FILENO, kMessage, sizeof kMessage - 1);
    (void)ignored;
    struct sigaction dfl{};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    sigset_t just_this;
    sigemptyset(&just_this);
    sigaddset(&just_this, sig);
    pthread_sigmask(SIG_UNBLOCK, &just_this, nullptr);
    raise(sig);  // delivered to this thread, with the default action: the process ends
  }
  errno = saved_errno;
  return false;
}

void on_stop_signal(int sig) { record_stop_signal(sig); }

sigset_t stop_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : kStopSignals) sigaddset(&set, sig);
  return set;
}

// A child forked from a thread with the stop signals blocked would keep them blocked
// across exec; it gets the default disposition back instead.
void unblock_in_child() {
  const sigset_t set = stop_signal_set();
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

[[noreturn]] void signal_thread_main(sigset_t set) {
  for (;;) {
    int sig = 0;
    // Recorded first, then the start-up state read (Note [A stop signal during start-up]).
    if (sigwait(&set, &sig) != 0 || !record_stop_signal(sig)) continue;
    if (begin_startup_exit()) exit_during_startup(sig);
    std::lock_guard<std::mutex> lock(g_acknowledge_mu);
    if (g_acknowledge) {
      try {
        g_acknowledge(sig);
      } catch (...) {
      }
    }
  }
}

}  // namespace

StopSignalAction classify_stop_signal(int pending_sig, int64_t pending_ns, int sig, int64_t now_ns) {
  if (pending_sig == 0) return StopSignalAction::kRequestStop;
  if (sig != SIGTERM && sig != SIGINT) return StopSignalAction::kIgnoreRepeat;
  // The handler publishes the signal before its time, so a copy delivered to another
  // thread at the same moment can see the signal with no time yet (0): it is the
  // duplicate the window is for, not a second request 'now - 0' ns later.
  if (pending_ns == 0) return StopSignalAction::kIgnoreRepeat;
  if (now_ns - pending_ns < kDuplicateSignalWindowNs) return StopSignalAction::kIgnoreRepeat;
  return StopSignalAction::kExitImmediately;
}

// Note [Signals never interrupt kernels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A signal handler runs on the stack of whichever thread the kernel picks, below that thread's
// stack pointer. oneDNN's JIT sgemm kernels (2.x up to 3.11; oneDNN issue #4845, fixed by PR
// #4855) point rsp into the heap while they run, so a signal handled during a linear layer writes
// its frame over heap memory (heap corruption, or a garbage tensor); a handler on an alternate
// stack avoids it. So the stop signals are never handled on a computing thread:
// install_stop_signal_handlers() blocks them in the calling thread (main, before it starts any
// other thread; threads inherit the mask) and starts a thread that takes them with sigwait() and
// does what the handler would. The handler stays installed for a thread started earlier, and a
// forked child gets the signals unblocked again. Only process-directed signals reach that thread
// (kill, not raise or pthread_kill aimed at another thread), which is how the launcher, SLURM and
// users send them.
void install_stop_signal_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    // The fallback for a thread started before this call, which does not block them.
    struct sigaction sa{};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int sig : kStopSignals) sigaction(sig, &sa, nullptr);
    // Note [Signals never interrupt kernels]: blocked here, so in every thread this one
    // starts from now on, and taken by a thread of their own.
    const sigset_t set = stop_signal_set();
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    pthread_atfork(nullptr, nullptr, unblock_in_child);
    std::thread(signal_thread_main, set).detach();
  });
}

void arm_startup_stop(StartupStopAction action) {
  g_startup_action = std::move(action);
  g_startup.store(kArmed);
  // Armed, then the pending signal read: the mirror of the signal thread's order.
  if (const int sig = g_pending_sig.load(); sig != 0 && begin_startup_exit()) exit_during_startup(sig);
}

void disarm_startup_stop() {
  int armed = kArmed;
  if (g_startup.compare_exchange_strong(armed, kDone) || armed != kExiting) return;
  for (;;) ::pause();  // the signal thread is ending the process
}

int pending_stop_signal() { return g_pending_sig.load(); }

// Note [An acknowledgement never outlives the run]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The acknowledgement logs through spdlog. Left set when a run ended on an error, a SIGTERM the
// launcher sent while the process was exiting (another rank failed too) made the signal thread log
// through a logger the static destructors had already taken apart: a SIGSEGV on the way out, in
// place of the rank's exit code. So the run clears it on every way out
// (ScopedStopAcknowledgement), and clearing waits for a call in progress.
void set_stop_acknowledgement(StopAcknowledgement acknowledge) {
  std::lock_guard<std::mutex> lock(g_acknowledge_mu);
  g_acknowledge = acknowledge;
}

void clear_pending_stop_signal() {
  g_pending_sig.store(0);
  g_pending_ns.store(0);
}

// Note [Stop votes]
// ~~~~~~~~~~~~~~~~~
// What each rank contributes to the stop agreement: 0 for "carry on", else the signal it received
// and its rank packed into one int64 so that the largest vote picks the highest signal number and,
// among the ranks that received it, the lowest rank. Every rank then names the same signal and
// rank in its message.
int64_t encode_stop_vote(int sig, int rank) {
  if (sig <= 0) return 0;
  constexpr int64_t kRankField = 0xFFFFFFFFLL;
  return (static_cast<int64_t>(sig) << 32) | (kRankField - static_cast<int64_t>(static_cast<uint32_t>(rank)));
}

StopVote decode_stop_vote(int64_t vote) {
  if (vote <= 0) return {};
  constexpr int64_t kRankField = 0xFFFFFFFFLL;
  return {static_cast<int>(vote >> 32), static_cast<int>(kRankField - (vote & kRankField))};
}

std::string stop_signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGHUP: return "SIGHUP";
    default: return fmt::format("signal {}", sig);
  }
}

struct StartupStop::Progress {
  std::mutex mu;
  std::string checkpoint;  // empty: none
  int64_t epoch = 0;
  int64_t step = 0;
};

StartupStop::StartupStop(int rank) : progress_(std::make_shared<Progress>()) {
  arm_startup_stop([rank, progress = progress_](int sig) {
    StopRecord record;
    {
      std::lock_guard<std::mutex> lock(progress->mu);
      record.checkpoint = progress->checkpoint;
      record.epoch = progress->epoch;
      record.step = progress->step;
    }
    record.rank = rank;
    record.signal = stop_signal_name(sig);
    record.signal_rank = rank;
    record.during_startup = true;
    record.message = fmt::format(
        "received {} during start-up, before the first step: stopped at once; {}", record.signal,
        record.checkpoint.empty()
            ? std::string("no checkpoint to resume from, so running the command again starts from the beginning")
            : fmt::format("the checkpoint {} is untouched and running the same command again resumes from it",
                          record.checkpoint));
    // The record first: it is what the launcher reads, and a log line can block on a
    // full pipe.
    write_stop_record(record);
    spdlog::warn("{}", record.message);
    spdlog::default_logger()->flush();
  });
}

// Start-up may also end in an error; its record must not race the start-up exit's
// (both write the error file), so leaving start-up disarms first.
StartupStop::~StartupStop() { disarm(); }

void StartupStop::resumes_from(const std::string& checkpoint) {
  std::lock_guard<std::mutex> lock(progress_->mu);
  progress_->checkpoint = checkpoint;
}

void StartupStop::at_position(int64_t epoch, int64_t step) {
  std::lock_guard<std::mutex> lock(progress_->mu);
  progress_->epoch = epoch;
  progress_->step = step;
}

void StartupStop::disarm() { disarm_startup_stop(); }

}  // namespace mtrain
