#include "core/trace.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"

namespace mtrain::trace {

// Note [Timeline spans]
// ~~~~~~~~~~~~~~~~~~~~~
// A span is a name, a row and two steady-clock readings; names are string literals, so recording
// one is a clock read and a push under a mutex, with no allocation once the buffer has grown. The
// training thread records nearly all of them; the all-reduce spans are recorded by it too, after
// the wait, from the launch time the reducer kept and the completion time the backend stamped on
// the Work (collectives/process_group.h). Memory is bounded by the span cap (about 50 bytes each)
// and, in practice, by the step window the loop records (--trace-steps). The file is Chrome's
// trace-event JSON: complete events ("ph":"X") in microseconds since the rank's first clock
// reading, rows named by metadata events, and an "mtrain" object with what the merge needs.
namespace {

struct Recorder {
  std::mutex mu;
  std::vector<SpanRecord> spans;
  size_t max_spans = 0;
  size_t dropped = 0;
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

std::atomic<bool> g_started{false};
std::atomic<bool> g_recording{false};

const char* row_name(int row, std::string& storage) {
  if (row == kTrainRow) return "training thread";
  storage = fmt::format("all-reduce, bucket {}", row - kFirstBucketRow);
  return storage.c_str();
}

}  // namespace

void start(size_t max_spans) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.spans.clear();
  // All at once, so that recording never allocates (a Span records from its destructor).
  r.spans.reserve(max_spans);
  r.max_spans = max_spans;
  r.dropped = 0;
  g_started.store(true);
}

bool started() { return g_started.load(std::memory_order_relaxed); }

void set_recording(bool on) { g_recording.store(on && started(), std::memory_order_relaxed); }

bool recording() { return g_recording.load(std::memory_order_relaxed); }

int64_t to_ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

namespace {

// Keeps `span` if there is room, else counts it as dropped.
void keep(const SpanRecord& span) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.spans.size() >= r.max_spans) {
    ++r.dropped;
    return;
  }
  r.spans.push_back(span);
}

}  // namespace

void record(const char* name, const char* category, int row, Clock::time_point start, Clock::time_point end,
            const char* arg_name, int64_t arg) {
  if (recording()) keep({name, category, row, to_ns(start), to_ns(end), arg_name, arg});
}

Span::Span(const char* name, const char* category, const char* arg_name, int64_t arg)
    : name_(name), category_(category), arg_name_(arg_name), arg_(arg), on_(recording()) {
  if (on_) start_ = Clock::now();
}

Span::~Span() {
  if (!on_) return;
  // Recorded even when recording was switched off meanwhile: the span began inside the window.
  keep({name_, category_, kTrainRow, to_ns(start_), to_ns(Clock::now()), arg_name_, arg_});
}

std::vector<SpanRecord> spans() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.spans;
}

size_t dropped() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.dropped;
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(in >> id)) return "";
  return id;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "unknown";
  return name;
}

void write_rank_file(const std::string& path, int rank, int world, const std::string& device,
                     const ClockSync& clock) {
  MTRAIN_CHECK(!clock.sync_ns.empty(), "a rank's trace needs at least one clock reading");
  const std::vector<SpanRecord> all = spans();
  const int64_t origin = clock.sync_ns.front();
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", rank}, {"tid", 0},
                    {"args", {{"name", fmt::format("rank {} ({})", rank, clock.host)}}}});
  events.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", rank}, {"tid", 0},
                    {"args", {{"sort_index", rank}}}});
  std::vector<int> rows;
  for (const SpanRecord& s : all) {
    if (std::find(rows.begin(), rows.end(), s.row) == rows.end()) rows.push_back(s.row);
  }
  for (int row : rows) {
    std::string storage;
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", rank}, {"tid", row},
                      {"args", {{"name", row_name(row, storage)}}}});
    events.push_back({{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", rank}, {"tid", row},
                      {"args", {{"sort_index", row}}}});
  }
  for (const SpanRecord& s : all) {
    nlohmann::json e = {{"ph", "X"},
                        {"name", s.name},
                        {"cat", s.category},
                        {"pid", rank},
                        {"tid", s.row},
                        {"ts", static_cast<double>(s.start_ns - origin) / 1e3},
                        {"dur", static_cast<double>(s.end_ns - s.start_ns) / 1e3}};
    if (s.arg_name != nullptr) e["args"] = {{s.arg_name, s.arg}};
    events.push_back(std::move(e));
  }
  const nlohmann::json file = {{"traceEvents", std::move(events)},
                               {"displayTimeUnit", "ms"},
                               {"mtrain", {{"format", 1},
                                           {"rank", rank},
                                           {"world_size", world},
                                           {"host", clock.host},
                                           {"boot_id", clock.boot_id},
                                           {"device", device},
                                           {"clock_sync_ns", clock.sync_ns},
                                           {"dropped_spans", dropped()}}}};
  replace_file(path, file.dump() + "\n");
}

}  // namespace mtrain::trace
