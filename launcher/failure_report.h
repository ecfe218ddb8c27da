// Worker failures, their error files, the choice of root cause, and the report printed
// on stderr when a gang fails, or stops on a signal (Note [Workers stopped on a signal]
// in attempt.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "core/main_guard.h"

#include "launcher/worker_process.h"

namespace mtrain::launch {

struct Failure {
  // The failed worker; global_rank < 0 means the agent itself (a signal it received, a
  // lost store), described by `message`.
  int global_rank = -1;
  int local_rank = -1;
  int node_rank = 0;
  std::string host;
  long pid = 0;
  ExitStatus status;
  double timestamp = 0;  // seconds since the epoch
  bool timestamp_from_error_file = false;
  bool sigkilled_by_launcher = false;  // ignored SIGTERM for --term_timeout
  std::string error_file;  // path when the worker wrote one, else empty
  std::string message;     // from the error file (or the agent's own description)
  std::string traceback;   // optional extra detail from the error file
  bool will_repeat = false;  // its error file says every attempt would fail the same way
  // Ranks of its node found stopped (SIGSTOP) when that node's teardown began: a collective
  // timeout that names no missing rank points at them (Note [Root cause] in failure_report.cpp).
  std::vector<int> stopped_peers;
};

nlohmann::json failure_to_json(const Failure& f);
// Throws InvalidArgument when `j` is not a Failure written by failure_to_json.
Failure failure_from_json(const nlohmann::json& j);

// The "stopped" object of a worker's record (trainer/stopping/error_file.h).
struct StopInfo {
  std::string signal;       // "SIGTERM"
  int signal_rank = -1;     // a rank that received it
  int64_t epoch = 0;
  int64_t step = 0;         // the last optimizer step done
  std::string checkpoint;   // written at that step; empty: none
  // Stopped before its first step (Note [A stop signal during start-up] in
  // trainer/stopping/stop_signals.cpp): epoch and step are those of the checkpoint it would resume.
  bool during_startup = false;
};

// What a worker wrote to MTRAIN_ERROR_FILE. Accepts mtrain's flat record
// {"message": "...", "timestamp": 1.7e9, ...} and torchrun's nested
// {"message": {"message": "...", "extraInfo": {"timestamp": "...", "py_callstack": ...}}}.
struct ErrorRecord {
  std::string message;
  std::optional<double> timestamp;
  std::string traceback;
  std::optional<StopInfo> stopped;  // a stop record (Note [Workers stopped on a signal])
  bool will_repeat = false;         // "will_repeat": true (Note [Errors that will repeat])
};
// nullopt when the file does not exist; a file that cannot be parsed yields a record
// whose message says so (the worker may have died mid-write).
std::optional<ErrorRecord> read_error_file(const std::filesystem::path& path);

// One line of advice for a worker that died of `sig`; empty when there is none.
std::string signal_hint(int sig, bool sent_by_launcher);
// Advice for the failure as a whole (signals, and shell-style exit codes 129..192).
std::string failure_hint(const Failure& f);

// Index of the failure that caused the others: a death by a signal the launcher did not
// send, else one whose message does not say a peer vanished, else any; the earliest of
// its class (Note [Root cause] in failure_report.cpp). `failures` must not be empty.
size_t pick_root_cause(const std::vector<Failure>& failures);

// How one worker of a failed attempt ended, as the report counts it (Note [Root cause] in
// failure_report.cpp).
struct WorkerEnd {
  ExitStatus status;
  double exit_time = 0;                   // seconds since the epoch, as the launcher saw it
  std::optional<double> error_time;       // its error record's moment; nullopt without a record
  bool sigkilled_by_launcher = false;     // the launcher SIGKILLed it (teardown, or found stopped)
};
enum class WorkerEndKind {
  kFailedOnItsOwn,     // a failure of its own: a candidate for the root cause
  kStoppedByTeardown,  // ended by the launcher's teardown, not a failure
  kExitedEarly,        // exited 0, not after a teardown (often what its peers failed on)
  kUncounted,          // failed, but no teardown began to tell when (none is reported)
};
// `teardown_started`: when the teardown began, in seconds since the epoch; 0 when none did.
WorkerEndKind classify_worker_end(const WorkerEnd& end, double teardown_started);

// Whether the launcher sends `sig` to its workers (the teardown's SIGTERM, the signals it
// forwards); a death by any other signal is the worker's own.
bool launcher_sends(int sig);

// The ranks a collective's timeout message names as never having reached it; empty when
// the message names none.
std::vector<int> ranks_named_missing(const std::string& message);

// Whether a collective's timeout message says every rank reached it (so it names none).
bool says_every_rank_arrived(const std::string& message);

struct FailureReport {
  std::string program;
  int attempt = 0;
  int max_restarts = 0;
  Failure root_cause;
  bool root_cause_remote = false;    // reported by another node's agent
  // Why restarts that were left are not used ("" when none were, or they were used).
  std::string restarts_unused_because;
  std::vector<Failure> other_failures;
  std::vector<int> stopped_ranks;    // ended by the launcher's teardown
  std::vector<int> sigkilled_ranks;  // of those, the ones that ignored SIGTERM
  // Of those, the ones found stopped (SIGSTOP) when the teardown began, and SIGKILLed
  // (Note [Stopped workers at teardown] in attempt.cpp).
  std::vector<int> found_stopped_ranks;
  // Exited 0 before the teardown: a rank that leaves while its peers still need it is
  // often what they failed on (a collective timing out), so it is named.
  std::vector<int> exited_early_ranks;
  double term_timeout_s = 0;
};

// The multi-line report (ends with a newline).
std::string format_failure_report(const FailureReport& report);

struct StoppedWorker {
  int global_rank = 0;
  int local_rank = 0;
  int node_rank = 0;
  StopInfo info;
};

struct StopReport {
  std::string program;
  int attempt = 0;
  std::optional<int> launcher_signal;  // a signal this launcher received and forwarded
  std::vector<StoppedWorker> stopped;  // this node's workers, by rank
};

// The report printed when every worker stopped on a signal (ends with a newline).
std::string format_stop_report(const StopReport& report);

// "2025-11-21T12:34:56.789Z"
std::string format_utc(double epoch_seconds);

}  // namespace mtrain::launch
