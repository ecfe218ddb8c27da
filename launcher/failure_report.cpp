#include "launcher/failure_report.h"

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace mtrain::launch {
namespace {

constexpr int kReportWidth = 64;

// A finite number of seconds, or a string holding one (torchrun writes strings). "nan"
// and "inf" are refused: NaN never compares earlier, so it would keep the root-cause
// place whatever else failed, and it cannot be printed as a time.
std::optional<double> as_seconds(const nlohmann::json& j) {
  std::optional<double> v;
  if (j.is_number()) v = j.get<double>();
  if (j.is_string()) {
    try {
      size_t used = 0;
      const std::string s = j.get<std::string>();
      const double parsed = std::stod(s, &used);
      if (used == s.size()) v = parsed;
    } catch (const std::exception&) {
    }
  }
  if (v && !std::isfinite(*v)) return std::nullopt;
  return v;
}

// At most `bytes` bytes of `text`, not cutting a UTF-8 sequence in half.
std::string utf8_prefix(const std::string& text, size_t bytes) {
  if (text.size() <= bytes) return text;
  size_t end = bytes;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end);
}

std::string indent_continuation(const std::string& text, const std::string& pad) {
  std::string out;
  for (char c : text) {
    out += c;
    if (c == '\n') out += pad;
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == '\n')) out.pop_back();
  return out;
}

std::string who(const Failure& f) {
  if (f.global_rank < 0) return fmt::format("the launcher on node {} ({})", f.node_rank, f.host);
  return fmt::format("rank {} (local_rank {}, node {})", f.global_rank, f.local_rank, f.node_rank);
}

}  // namespace

nlohmann::json failure_to_json(const Failure& f) {
  return nlohmann::json{
      {"rank", f.global_rank},        {"local_rank", f.local_rank},
      {"node_rank", f.node_rank},     {"host", f.host},
      {"pid", f.pid},                 {"signaled", f.status.signaled},
      {"exit_code", f.status.code},   {"signal", f.status.signal},
      {"timestamp", f.timestamp},     {"timestamp_from_error_file", f.timestamp_from_error_file},
      {"sigkilled_by_launcher", f.sigkilled_by_launcher},
      {"error_file", f.error_file},   {"message", f.message},
      {"traceback", f.traceback},     {"will_repeat", f.will_repeat},
      {"stopped_peers", f.stopped_peers},
  };
}

Failure failure_from_json(const nlohmann::json& j) {
  try {
    Failure f;
    f.global_rank = j.at("rank").get<int>();
    f.local_rank = j.at("local_rank").get<int>();
    f.node_rank = j.at("node_rank").get<int>();
    f.host = j.at("host").get<std::string>();
    f.pid = j.at("pid").get<long>();
    f.status.signaled = j.at("signaled").get<bool>();
    f.status.code = j.at("exit_code").get<int>();
    f.status.signal = j.at("signal").get<int>();
    f.timestamp = j.at("timestamp").get<double>();
    f.timestamp_from_error_file = j.at("timestamp_from_error_file").get<bool>();
    f.will_repeat = j.value("will_repeat", false);
    f.stopped_peers = j.value("stopped_peers", std::vector<int>{});
    f.sigkilled_by_launcher = j.at("sigkilled_by_launcher").get<bool>();
    f.error_file = j.at("error_file").get<std::string>();
    f.message = j.at("message").get<std::string>();
    f.traceback = j.at("traceback").get<std::string>();
    return f;
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("failure record from another node: expected the "
                                      "launcher's JSON fields, found {} ({})",
                                      j.dump(), e.what()));
  }
}

std::optional<ErrorRecord> read_error_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  ErrorRecord rec;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    rec.message = fmt::format("(error file is not valid JSON: {}; it starts with '{}')",
                              e.what(), utf8_prefix(text.str(), 200));
    return rec;
  }
  if (!j.is_object()) {
    rec.message = fmt::format("(error file holds {}, expected a JSON object)", j.type_name());
    return rec;
  }
  const auto field = [&](const nlohmann::json& obj, const char* key) -> const nlohmann::json* {
    const auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  };
  if (const auto* m = field(j, "message")) {
    if (m->is_string()) {
      rec.message = m->get<std::string>();
    } else if (m->is_object()) {  // torchrun's @record layout
      if (const auto* inner = field(*m, "message"); inner && inner->is_string()) {
        rec.message = inner->get<std::string>();
      }
      if (const auto* extra = field(*m, "extraInfo"); extra && extra->is_object()) {
        if (const auto* ts = field(*extra, "timestamp")) rec.timestamp = as_seconds(*ts);
        if (const auto* cs = field(*extra, "py_callstack"); cs && cs->is_string()) {
          rec.traceback = cs->get<std::string>();
        }
      }
    }
  }
  if (const auto* ts = field(j, "timestamp")) rec.timestamp = as_seconds(*ts);
  if (const auto* w = field(j, "will_repeat"); w && w->is_boolean()) rec.will_repeat = w->get<bool>();
  if (const auto* st = field(j, "stopped"); st && st->is_object()) {
    // A malformed stop record is no stop record: the worker is then judged as failed.
    try {
      StopInfo info;
      info.signal = st->at("signal").get<std::string>();
      info.signal_rank = st->at("signal_rank").get<int>();
      info.epoch = st->at("epoch").get<int64_t>();
      info.step = st->at("step").get<int64_t>();
      info.checkpoint = st->at("checkpoint").get<std::string>();
      info.during_startup = st->value("during_startup", false);
      rec.stopped = info;
    } catch (const nlohmann::json::exception&) {
    }
  }
  for (const char* key : {"traceback", "stack"}) {
    if (const auto* t = field(j, key); t && t->is_string()) rec.traceback = t->get<std::string>();
  }
  if (rec.message.empty()) rec.message = "(error file has no \"message\")";
  return rec;
}

std::string signal_hint(int sig, bool sent_by_launcher) {
  switch (sig) {
    case SIGKILL:
      if (sent_by_launcher) {
        return "killed by the launcher: it ignored SIGTERM for --term_timeout";
      }
      return "SIGKILL came from outside the launcher: often the kernel's OOM killer "
             "(check `dmesg` or `journalctl -k` for \"Out of memory\"), or a scheduler "
             "enforcing a memory or time limit";
    case SIGSEGV:
      return "a crash in native code (invalid memory access); get a core dump "
             "(ulimit -c unlimited) or run the worker under gdb";
    case SIGABRT:
      return "the worker aborted: a failed assertion, an uncaught C++ exception "
             "(std::terminate) or detected heap corruption; its stderr says which";
    case SIGBUS:
      return "bad access to mapped memory: often /dev/shm is full (check `df -h /dev/shm`) "
             "or a memory-mapped file was truncated";
    case SIGFPE:
      return "an arithmetic fault in native code (e.g. integer division by zero)";
    case SIGILL:
      return "an illegal instruction: usually a binary built for a newer CPU "
             "(-march=native on another machine)";
    case SIGTERM:
      return sent_by_launcher ? "stopped by the launcher"
                              : "SIGTERM came from outside the launcher: a scheduler (time "
                                "limit, preemption), `kill`, or a shutdown";
    case SIGINT:
      return "interrupted (Ctrl-C, or SIGINT sent to the worker directly)";
    case SIGHUP:
      return "hang-up: the terminal or ssh session closed; run under a scheduler, tmux "
             "or nohup";
    case SIGPIPE:
      return "wrote to a closed pipe or socket (the reader or a peer went away)";
    case SIGXCPU:
      return "CPU time limit exceeded (ulimit -t)";
    case SIGXFSZ:
      return "file size limit exceeded (ulimit -f)";
    default:
      return {};
  }
}

std::string failure_hint(const Failure& f) {
  if (f.status.signaled) return signal_hint(f.status.signal, f.sigkilled_by_launcher);
  // A shell (or anything that runs the real worker as a child) reports a child's death
  // by signal N as exit code 128 + N.
  if (f.status.code > 128 && f.status.code <= 128 + 64) {
    const int sig = f.status.code - 128;
    const std::string inner = signal_hint(sig, false);
    return fmt::format("exit code {} usually means a child process died of {}{}{}",
                       f.status.code, signal_name(sig), inner.empty() ? "" : ": ", inner);
  }
  return {};
}

// Note [Root cause]
// ~~~~~~~~~~~~~~~~~
// When one rank dies, the others usually fail soon after (a broken collective, our own
// SIGTERM), and only the first failure explains anything. Judged by arrival order alone,
// the answer depends on when the launcher reaps: a launcher held up 50 ms (a loaded node)
// sees a peer's "connection reset by peer" error file stamped before the exit of the rank
// that vanished. So the root cause is chosen by causality first, time second:
//   1. a death by a signal the launcher did not send (the OOM killer, a segfault, kill -9):
//      it cannot be the consequence of a peer's failure (SIGPIPE, a write to a vanished
//      peer, is the exception and counts with class 3);
//   2. any other failure whose message does not say a peer vanished;
//   3. a failure that says a peer vanished (a reset or closed connection, a collective a
//      rank never reached): the consequence of another.
// Within a class the earliest wins: the timestamp in its error file when it wrote one (the
// moment it hit the error, which may be well before it exited), else the moment the
// launcher saw it exit. The launcher exits with the root cause's status. Workers that ended
// only because the launcher stopped them, without an error file, are not failures: the
// report names them on one line. Across nodes the first agent to announce a failure
// (compare_set on the attempt's "failed" key) publishes its root cause, and every node
// prints that one.
// A collective that timed out names the ranks that never reached it; the evidence points at
// them, not at the healthy rank that reported it. A rank stopped (SIGSTOP) inside the
// collective had reached it, so the message names nobody; the launcher finds it stopped when
// its teardown begins, and the root cause carries the ranks of its node found so. A stopped
// rank on another node than the reporter is not seen: the report then names the reporter.

namespace {

// What a worker's message says when its failure is a peer's doing. Gloo, NCCL, the store
// and mtrain's own collectives word it these ways.
bool says_a_peer_vanished(const std::string& message) {
  static const char* const kSigns[] = {
      "reset by peer",       "closed by peer",      "Broken pipe",        "closed the connection",
      "has the server exited", "never reached it",  "remote process exited", "Connection refused",
  };
  return std::any_of(std::begin(kSigns), std::end(kSigns),
                     [&](const char* sign) { return message.find(sign) != std::string::npos; });
}

int causality_class(const Failure& f) {
  if (f.sigkilled_by_launcher) return 2;  // ended by the teardown another failure began
  // SIGPIPE: a write to a socket whose peer is gone, the signal form of "reset by peer".
  if (f.status.signaled && f.status.signal == SIGPIPE) return 2;
  // A signal the launcher did not send outranks another rank's exit code, even when the
  // rank wrote an error first (it crashed on its way out); unless that error says a peer
  // vanished, which makes the crash a consequence.
  if (says_a_peer_vanished(f.message)) return 2;
  return f.global_rank >= 0 && f.status.signaled ? 0 : 1;
}

}  // namespace

size_t pick_root_cause(const std::vector<Failure>& failures) {
  MTRAIN_CHECK(!failures.empty(), "no failures to choose a root cause from");
  size_t best = 0;
  for (size_t i = 1; i < failures.size(); ++i) {
    const int ci = causality_class(failures[i]), cb = causality_class(failures[best]);
    if (ci < cb || (ci == cb && failures[i].timestamp < failures[best].timestamp)) best = i;
  }
  return best;
}

bool launcher_sends(int sig) {
  // SIGTERM at teardown; SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 forwarded.
  return sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT || sig == SIGUSR1 || sig == SIGUSR2;
}

// Note [Root cause]: a worker failed on its own when it failed before the teardown began (by
// its exit, or by the moment in its error record, however late the launcher saw it exit), or
// died of a signal the launcher did not send (the OOM killer's SIGKILL, a segfault) at any
// moment. The launcher's own SIGKILLs it marks, so they are not taken for the worker's.
WorkerEndKind classify_worker_end(const WorkerEnd& end, double teardown_started) {
  const ExitStatus& st = end.status;
  const bool killed_by_another_signal =
      st.signaled && !end.sigkilled_by_launcher && !launcher_sends(st.signal);
  const bool failed_before_teardown = (!st.success() && end.exit_time < teardown_started) ||
                                      (end.error_time && *end.error_time < teardown_started);
  if (failed_before_teardown || killed_by_another_signal) return WorkerEndKind::kFailedOnItsOwn;
  if (teardown_started > 0 && end.exit_time >= teardown_started) return WorkerEndKind::kStoppedByTeardown;
  return st.success() ? WorkerEndKind::kExitedEarly : WorkerEndKind::kUncounted;
}

std::vector<int> ranks_named_missing(const std::string& message) {
  // collectives/collective_progress.cpp: "rank 3 never reached it (...)" or
  // "ranks 1, 2 never reached it (...)".
  std::vector<int> ranks;
  const size_t end = message.find(" never reached it");
  if (end == std::string::npos) return ranks;
  size_t start = message.rfind("rank", end);
  if (start == std::string::npos) return ranks;
  start = message.find(' ', start);
  std::string list = message.substr(start, end - start);
  for (char& c : list) c = (c == ',') ? ' ' : c;
  std::istringstream in(list);
  int r = 0;
  while (in >> r) ranks.push_back(r);
  return ranks;
}

bool says_every_rank_arrived(const std::string& message) {
  // collectives/collective_progress.cpp: "every rank reached it, so a peer is stuck inside it ...".
  return message.find("every rank reached it") != std::string::npos;
}

std::string format_utc(double epoch_seconds) {
  const auto whole = static_cast<time_t>(std::floor(epoch_seconds));
  const int millis = static_cast<int>((epoch_seconds - static_cast<double>(whole)) * 1000.0);
  std::tm tm{};
  gmtime_r(&whole, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, millis);
}

std::string format_failure_report(const FailureReport& r) {
  const std::string heavy(kReportWidth, '=');
  const std::string light(kReportWidth, '-');
  const Failure& rc = r.root_cause;
  std::string out;
  out += heavy + "\n";
  out += fmt::format("mtrain-launch: {} FAILED (attempt {}, {})\n", r.program, r.attempt,
                     r.attempt >= r.max_restarts
                         ? (r.max_restarts == 0 ? "no restarts configured"
                                                : "no restarts left")
                     : !r.restarts_unused_because.empty()
                         ? fmt::format("{} restart(s) left, not used: {}", r.max_restarts - r.attempt,
                                       r.restarts_unused_because)
                         : fmt::format("{} restart(s) left", r.max_restarts - r.attempt));
  out += light + "\n";
  out += fmt::format("Root cause{}:\n",
                     r.root_cause_remote ? ", reported by another node" : "");
  const std::string pad = "               ";
  if (rc.global_rank >= 0) {
    // Note [Root cause]: the ranks a collective's timeout points at.
    const std::vector<int> missing = ranks_named_missing(rc.message);
    const bool stopped_inside = missing.empty() && says_every_rank_arrived(rc.message) && !rc.stopped_peers.empty();
    if (!missing.empty() || stopped_inside) {
      out += fmt::format("  rank       : {} ({}; reported by rank {})\n",
                         fmt::join(stopped_inside ? rc.stopped_peers : missing, ", "),
                         stopped_inside ? "found stopped (SIGSTOP) inside the collective that timed out"
                                        : "never reached the collective that timed out",
                         rc.global_rank);
      out += fmt::format("  reported by: rank {} (local_rank {}, node {})\n", rc.global_rank, rc.local_rank,
                         rc.node_rank);
    } else {
      out += fmt::format("  rank       : {} (local_rank {}, node {})\n", rc.global_rank, rc.local_rank,
                         rc.node_rank);
    }
    out += fmt::format("  host       : {}\n", rc.host);
    out += fmt::format("  time       : {}{}\n", format_utc(rc.timestamp),
                       rc.timestamp_from_error_file ? " (from its error file)" : " (exit seen)");
    out += fmt::format("  pid        : {}\n", rc.pid);
    out += fmt::format("  exit       : {}\n", rc.status.describe());
    if (const std::string hint = failure_hint(rc); !hint.empty()) {
      out += fmt::format("  hint       : {}\n", hint);
    }
    out += fmt::format("  error_file : {}\n",
                       rc.error_file.empty() ? "<none: the worker wrote no error file>"
                                             : rc.error_file);
    if (!rc.message.empty()) {
      out += fmt::format("  message    : {}\n", indent_continuation(rc.message, pad));
    }
    if (!rc.traceback.empty()) {
      out += fmt::format("  traceback  : {}\n", indent_continuation(rc.traceback, pad));
    }
  } else {
    out += fmt::format("  {}: {}\n", who(rc), rc.message);
    out += fmt::format("  time       : {}\n", format_utc(rc.timestamp));
  }
  out += light + "\n";
  out += "Other failures:\n";
  if (r.other_failures.empty()) out += "  (none)\n";
  for (const Failure& f : r.other_failures) {
    out += fmt::format("  {}: {} at {}{}{}\n", who(f), f.status.describe(),
                       format_utc(f.timestamp), f.message.empty() ? "" : ": ",
                       indent_continuation(f.message, "    "));
  }
  if (!r.stopped_ranks.empty()) {
    out += fmt::format("Stopped by the launcher after the root cause: rank{} {}\n",
                       r.stopped_ranks.size() == 1 ? "" : "s",
                       fmt::join(r.stopped_ranks, ", "));
  }
  if (!r.sigkilled_ranks.empty()) {
    out += fmt::format("  of which ignored SIGTERM for --term_timeout {} s and got SIGKILL: rank{} {}\n",
                       r.term_timeout_s, r.sigkilled_ranks.size() == 1 ? "" : "s",
                       fmt::join(r.sigkilled_ranks, ", "));
  }
  if (!r.found_stopped_ranks.empty()) {
    out += fmt::format("  of which were found stopped (SIGSTOP) and got SIGKILL: rank{} {}\n",
                       r.found_stopped_ranks.size() == 1 ? "" : "s", fmt::join(r.found_stopped_ranks, ", "));
  }
  if (!r.exited_early_ranks.empty()) {
    out += fmt::format("Exited with status 0 before the failure, while their peers ran on: rank{} {}\n",
                       r.exited_early_ranks.size() == 1 ? "" : "s", fmt::join(r.exited_early_ranks, ", "));
  }
  out += heavy + "\n";
  return out;
}

std::string format_stop_report(const StopReport& r) {
  const std::string heavy(kReportWidth, '=');
  const std::string light(kReportWidth, '-');
  std::string out;
  out += heavy + "\n";
  out += fmt::format("mtrain-launch: {} STOPPED on a signal (attempt {}); not a failure\n", r.program, r.attempt);
  out += light + "\n";
  if (r.launcher_signal) {
    out += fmt::format("The launcher received {} and forwarded it to the workers.\n",
                       signal_name(*r.launcher_signal));
  }
  const auto during_startup = [](const StoppedWorker& w) { return w.info.during_startup; };
  const bool any_during_startup = std::any_of(r.stopped.begin(), r.stopped.end(), during_startup);
  const bool all_during_startup = std::all_of(r.stopped.begin(), r.stopped.end(), during_startup);
  out += any_during_startup ? "Every worker stopped:\n" : "Every worker finished its current step and stopped:\n";
  std::vector<std::string> checkpoints;
  for (const StoppedWorker& w : r.stopped) {
    const std::string when = w.info.during_startup
                                 ? std::string("during start-up, before its first step,")
                                 : fmt::format("after step {} (epoch {})", w.info.step, w.info.epoch);
    out += fmt::format("  rank {} (local_rank {}, node {}): stopped {} on {} (received by rank {})\n", w.global_rank,
                       w.local_rank, w.node_rank, when, w.info.signal, w.info.signal_rank);
    if (!w.info.checkpoint.empty() &&
        std::find(checkpoints.begin(), checkpoints.end(), w.info.checkpoint) == checkpoints.end()) {
      checkpoints.push_back(w.info.checkpoint);
    }
  }
  if (checkpoints.empty() && all_during_startup) {
    // Whether --checkpoint-dir was given is not in the stop record; nothing was written.
    out += "Checkpoint : none yet (the workers stopped before their first step); running the same command again "
           "starts from the beginning\n";
  } else if (checkpoints.empty()) {
    out += "Checkpoint : none (the workers ran without --checkpoint-dir); this run cannot be resumed\n";
  } else {
    out += fmt::format("Checkpoint : {}\n", fmt::join(checkpoints, ", "));
    out += all_during_startup
               ? "Resume     : run the same command again; the workers continue from that checkpoint, untouched\n"
               : "Resume     : run the same command again; the workers continue after that step\n";
  }
  out += fmt::format("Exit status: {} (stopped before the end, resumable), as the workers'\n",
                     kStoppedExitCode);
  out += heavy + "\n";
  return out;
}

}  // namespace mtrain::launch
