#include "trainer/trace/run_trace.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <system_error>

#include "core/error.h"
#include "trainer/trace/merge.h"

namespace mtrain {

namespace {

// Barriers whose exits the ranks' clocks are read at (Note [Aligning the ranks' clocks] in
// merge.cpp): a few rounds, so that the median discards a late one.
constexpr int kClockSyncRounds = 7;

}  // namespace

RunTrace::RunTrace(const TrainOptions& options, const TrainingRun& run) : dir_(options.trace_dir) {
  if (dir_.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw IoError(fmt::format("--trace {}: cannot create the directory: {}", dir_, ec.message()));
  trace::start();
  clock_.host = trace::host_name();
  ProcessGroup* control = run.control();
  for (int i = 0; i < (control != nullptr ? kClockSyncRounds : 1); ++i) {
    if (control != nullptr) control->barrier()->wait();
    clock_.sync_ns.push_back(trace::to_ns(trace::Clock::now()));
  }
  if (run.lead()) {
    spdlog::info("--trace: recording steps {}..{} (and every evaluation and checkpoint) into {}",
                 options.trace_first_step, options.trace_last_step, dir_);
  }
}

void RunTrace::write_rank_file(const TrainingRun& run) {
  trace::set_recording(false);
  trace::write_rank_file(trace::rank_trace_path(dir_, run.env.rank), run.env.rank, run.env.world_size, clock_);
  written_ = true;
  if (const size_t dropped = trace::dropped(); dropped > 0) {
    spdlog::warn("--trace: {} spans did not fit in the recorder's {} and were dropped; trace fewer steps "
                 "(--trace-steps)",
                 dropped, trace::kDefaultMaxSpans);
  }
}

void RunTrace::finish(const TrainingRun& run) {
  if (dir_.empty()) return;
  bool wrote = true;
  try {
    write_rank_file(run);
  } catch (const Error& e) {
    wrote = false;
    spdlog::warn("--trace: rank {}: {}; the run goes on without its timeline", run.env.rank, e.what());
  }
  // Every rank's file is in place (or known missing) before rank 0 looks.
  if (ProcessGroup* control = run.control()) control->barrier()->wait();
  if (!run.lead()) return;
  const std::string merged_path = (std::filesystem::path(dir_) / "trace.json").string();
  try {
    const trace::MergedTrace merged = trace::merge_trace_dir(dir_, merged_path);
    spdlog::info("--trace: wrote {} ({} spans from {} rank{}); open it in https://ui.perfetto.dev or "
                 "chrome://tracing",
                 merged_path, merged.spans, merged.summary.size(), merged.summary.size() == 1 ? "" : "s");
    for (const std::string& line : trace::describe_merged_trace(merged)) spdlog::info("--trace: {}", line);
  } catch (const Error& e) {
    spdlog::warn("--trace: rank files are in {} but were not merged: {}{}", dir_, e.what(),
                 wrote ? "" : " (this rank's file could not be written)");
  }
}

void RunTrace::write_after_failure(const TrainingRun& run) noexcept {
  if (dir_.empty() || written_) return;
  try {
    write_rank_file(run);
    spdlog::warn("--trace: the run failed; rank {}'s timeline up to the failure is in {}", run.env.rank,
                 trace::rank_trace_path(dir_, run.env.rank));
  } catch (const std::exception& e) {
    spdlog::warn("--trace: rank {}'s timeline could not be written: {}", run.env.rank, e.what());
  }
}

}  // namespace mtrain
