// Metrics as JSON lines: one object per event, one event per line, each line flushed as it is
// written so `tail -f` and a crashed run both see everything logged so far. Every object has
// "event"; the events and their fields are in Note [Metrics events] (metrics.cpp) and
// docs/training.md. Non-finite numbers are written as null. One writer thread.
#pragma once

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "tensor/tensor.h"
#include "trainer/loop/evaluate.h"

namespace mtrain {

class Reducer;
class StepExchange;

class MetricsWriter {
 public:
  // Disabled writer: write() does nothing.
  MetricsWriter() = default;
  enum class Mode { kTruncate, kAppend };
  // Creates `path` (kTruncate empties an existing file; kAppend, for a resumed run,
  // keeps the events already there); its directory must exist. Throws IoError.
  explicit MetricsWriter(const std::string& path, Mode mode = Mode::kTruncate);

  bool enabled() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }

  // Appends `event` as one line and flushes. A write that fails is logged once as a
  // warning and turns the writer off: metrics never end a run.
  void write(const nlohmann::json& event);

 private:
  std::string path_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_{nullptr, &std::fclose};
};

// A JSON number, or null when `v` is NaN or infinite.
nlohmann::json json_number(double v);

// Adds the memory figures of epoch events: the host tensor allocator's peak and what it
// holds, and on a GPU the device allocator's current use and reservation, so that
// growth from one epoch to the next shows.
void add_memory_fields(nlohmann::json& event, Device device);

// Adds the data-parallel figures of step and epoch events (docs/training.md,
// "Metrics"): comm_wait_sec, comm_hidden_fraction and bucket_launches of `reducer`,
// rank_waits of `exchange`, and syncbn_wait_sec when SyncBatchNorm runs
// (`syncbn_wait_seconds` >= 0).
void add_data_parallel_fields(nlohmann::json& event, const Reducer& reducer, const StepExchange& exchange,
                              double syncbn_wait_seconds);

// The evaluation of the initial weights when a run trains no step (--max-steps 0).
nlohmann::json initial_eval_event(const EvalResult& result);

}  // namespace mtrain
