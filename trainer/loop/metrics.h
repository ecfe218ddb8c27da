// Metrics as JSON lines: one object per event, one event per line, each line flushed
// as it is written so `tail -f` and a crashed run both see everything logged so far.
//
// Note [Metrics events]
// ~~~~~~~~~~~~~~~~~~~~~
// Every object has "event". The events mtrain-train writes:
//   {"event":"step","epoch":1,"step":50,"loss":0.61,"lr":0.1,"img_per_s":5210.4,
//    "images":5120,"sec":0.98}
//       every --log-every optimizer steps (counted over the whole run); "loss" is the
//       mean training loss over the steps since the previous step event (the window),
//       "images" and "sec" the window's images and seconds, "img_per_s" their ratio;
//   {"event":"epoch","epoch":1,"step":94,"train_loss":..,"train_acc":..,"test_acc":..,
//    "test_loss":..,"sec":..,"img_per_s":..,"devices":["cpu"]}
//       at the end of every epoch ("test_acc"/"test_loss" are null under --no-eval);
//   {"event":"eval","epoch":0,"step":0,"test_loss":..,"test_acc":..}
//       when a run trains no step (--max-steps 0), the evaluation of the initial weights.
// Non-finite numbers (a diverged loss) are written as null: JSON has no NaN.
#pragma once

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "tensor/tensor.h"
#include "trainer/loop/evaluate.h"

namespace mtrain {

class Reducer;

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

  // Appends `event` as one line and flushes. Throws IoError when the write fails.
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
// "Metrics"): comm_wait_sec, comm_hidden_fraction, bucket_launches and rank_waits of
// `reducer`, and syncbn_wait_sec when SyncBatchNorm runs (`syncbn_wait_seconds` >= 0).
void add_reducer_fields(nlohmann::json& event, const Reducer& reducer, double syncbn_wait_seconds);

// The evaluation of the initial weights when a run trains no step (--max-steps 0).
nlohmann::json initial_eval_event(const EvalResult& result);

}  // namespace mtrain
