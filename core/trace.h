// The timeline behind --trace: spans of named work (a step, its forward and backward, a gradient
// bucket's all-reduce, an evaluation), recorded in this process's memory and written as one
// Chrome trace-event file per rank, which trainer/trace merges into one file for Perfetto or
// chrome://tracing (Note [Timeline spans] in trace.cpp).
//
// Process-wide, like the logger. Nothing is recorded until start(); then only while
// recording() is on, which the training loop switches per step. Off, a Span costs one relaxed
// atomic load. Spans on one row must nest or follow one another; each
// gradient bucket has a row of its own because its all-reduce overlaps backward and the other
// buckets' (tests/trainer/trace/test_trace.cpp checks a real run's rows).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mtrain::trace {

using Clock = std::chrono::steady_clock;

// Rows (Chrome's "tid"): the training thread, and one per gradient bucket.
inline constexpr int kTrainRow = 0;
inline constexpr int kFirstBucketRow = 100;
inline int bucket_row(int bucket) { return kFirstBucketRow + bucket; }

// At most this many spans are kept per process; later ones are counted as dropped.
inline constexpr size_t kDefaultMaxSpans = 200000;

struct SpanRecord {
  const char* name;      // a string literal: the recorder keeps the pointer
  const char* category;  // "compute", "comm", "data", "io", "step"
  int row;
  int64_t start_ns;  // steady clock
  int64_t end_ns;
  const char* arg_name;  // nullptr: no argument
  int64_t arg;
};

// Enables the recorder (keeping at most `max_spans`); recording stays off until
// set_recording(true). Calling it again clears what was recorded.
void start(size_t max_spans = kDefaultMaxSpans);
bool started();
// Switches recording; without start() it stays off.
void set_recording(bool on);
bool recording();

int64_t to_ns(Clock::time_point t);

// Records [start, end) on `row` if recording() is on.
void record(const char* name, const char* category, int row, Clock::time_point start, Clock::time_point end,
            const char* arg_name = nullptr, int64_t arg = 0);

// Records its own lifetime on the training row, if recording() was on when it began.
class Span {
 public:
  Span(const char* name, const char* category, const char* arg_name = nullptr, int64_t arg = 0);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  const char* category_;
  const char* arg_name_;
  int64_t arg_;
  bool on_;
  Clock::time_point start_;
};

// What was recorded so far, in recording order, and how many spans did not fit.
std::vector<SpanRecord> spans();
size_t dropped();

// Where this rank's clock stood at moments every rank shares (Note [Aligning the ranks'
// clocks] in trainer/trace/merge.cpp).
struct ClockSync {
  std::string host;               // this rank's host name, for people
  std::string boot_id;            // the running kernel's boot id: one clock; empty if unknown
  std::vector<int64_t> sync_ns;   // steady-clock readings right after each of a series of barriers
};

// Writes the spans as a Chrome trace-event file (JSON) with this rank's identity, device ("cpu",
// "cuda:0") and clock readings; throws IoError when it cannot.
void write_rank_file(const std::string& path, int rank, int world, const std::string& device,
                     const ClockSync& clock);

// This machine's host name ("unknown" when it cannot be read).
std::string host_name();
// /proc/sys/kernel/random/boot_id: the same for every process on one running kernel (and so
// one steady clock), whatever the host names say; empty when it cannot be read.
std::string boot_id();

}  // namespace mtrain::trace
