#include "trainer/trace/run_trace.h"

#include <spdlog/spdlog.h>

#include <cstdint>
#include <filesystem>
#include <system_error>

#include "core/error.h"
#include "trainer/trace/merge.h"

namespace mtrain {

namespace {

// Barriers whose exits the ranks' clocks are read at (Note [Aligning the ranks' clocks] in
// merge.cpp): a few rounds, so that the median discards a late one.
constexpr int kClockSyncRounds = 7;

std::string merged_path(const std::string& dir) { return (std::filesystem::path(dir) / "trace.json").string(); }

// Note [No stale rank files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// DIR may hold an earlier run's files. Each rank removes its own file (rank 0 also the merged
// one) before the clock barriers, so that when rank 0 merges after the final barrier, every file
// it finds for ranks 0..world-1 was written by this run: a rank whose write failed leaves a gap
// the merge names, not an old file it would take for this run's.
bool prepare_directory(const std::string& dir, const TrainingRun& run) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    spdlog::warn("--trace {}: rank {} cannot create the directory ({}), so it records no timeline; training goes on",
                 dir, run.env().rank, ec.message());
    return false;
  }
  std::filesystem::remove(trace::rank_trace_path(dir, run.env().rank), ec);
  if (run.lead()) std::filesystem::remove(merged_path(dir), ec);
  return true;
}

}  // namespace

RunTrace::RunTrace(const TrainOptions& options, const TrainingRun& run) : dir_(options.trace_dir) {
  if (dir_.empty()) return;
  recording_ = prepare_directory(dir_, run);
  if (recording_) trace::start();
  clock_.host = trace::host_name();
  clock_.boot_id = trace::boot_id();
  ProcessGroup* control = run.control();
  for (int i = 0; i < (control != nullptr ? kClockSyncRounds : 1); ++i) {
    if (control != nullptr) control->barrier()->wait();
    clock_.sync_ns.push_back(trace::to_ns(trace::Clock::now()));
  }
  if (!run.lead()) return;
  spdlog::info("--trace: recording steps {}..{} (and every evaluation and checkpoint) into {}",
               options.trace_first_step, options.trace_last_step, dir_);
  const int64_t start = run.resumed ? run.resumed->total_steps : 0;
  const int64_t last = options.max_steps.value_or(INT64_MAX);
  if (options.trace_last_step <= start || options.trace_first_step > last) {
    spdlog::warn("--trace-steps {}:{} holds none of this run's steps ({}..{}: --trace-steps counts from the run's "
                 "first step, across resumes); evaluations and checkpoints are still recorded",
                 options.trace_first_step, options.trace_last_step, start + 1,
                 options.max_steps ? std::to_string(*options.max_steps) : std::string("the end"));
  }
}

bool RunTrace::write_rank_file(const TrainingRun& run) noexcept {
  trace::set_recording(false);
  if (!recording_) return false;
  try {
    trace::write_rank_file(trace::rank_trace_path(dir_, run.env().rank), run.env().rank, run.env().world_size,
                           run.compute().str(), clock_);
    written_ = true;
    if (const size_t dropped = trace::dropped(); dropped > 0) {
      spdlog::warn("--trace: {} spans did not fit in the recorder's {} and were dropped; trace fewer steps "
                   "(--trace-steps)",
                   dropped, trace::kDefaultMaxSpans);
    }
    return true;
  } catch (const std::exception& e) {
    spdlog::warn("--trace: rank {}: {}; the run goes on without its timeline", run.env().rank, e.what());
    return false;
  }
}

void RunTrace::finish(const TrainingRun& run) {
  if (dir_.empty()) return;
  const bool wrote = write_rank_file(run);
  // Every rank's file is in place (or known missing) before rank 0 looks.
  if (ProcessGroup* control = run.control()) control->barrier()->wait();
  if (!run.lead() || !wrote) return;
  try {
    const trace::MergedTrace merged = trace::merge_trace_dir(dir_, merged_path(dir_));
    spdlog::info("--trace: wrote {} ({} span{} from {} rank{}); open it in https://ui.perfetto.dev or "
                 "chrome://tracing",
                 merged_path(dir_), merged.spans, merged.spans == 1 ? "" : "s", merged.summary.size(),
                 merged.summary.size() == 1 ? "" : "s");
    for (const std::string& line : trace::describe_merged_trace(merged)) spdlog::info("--trace: {}", line);
  } catch (const std::exception& e) {
    spdlog::warn("--trace: the rank files in {} were not merged: {}", dir_, e.what());
  }
}

void RunTrace::write_after_failure(const TrainingRun& run) noexcept {
  if (dir_.empty() || written_) return;
  if (write_rank_file(run)) {
    spdlog::warn("--trace: the run failed; rank {}'s timeline up to the failure is in {}", run.env().rank,
                 trace::rank_trace_path(dir_, run.env().rank));
  }
}

}  // namespace mtrain
