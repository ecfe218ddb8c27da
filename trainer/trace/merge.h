// One timeline from every rank's --trace file: each rank a process row (its training thread and
// one row per gradient bucket), the ranks' clocks aligned (Note [Aligning the ranks' clocks] in
// merge.cpp), for Perfetto or chrome://tracing. Used by mtrain-train's rank 0 when every rank
// file is in one directory, and by the mtrain-trace command for files gathered from many hosts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mtrain::trace {

// What core/trace.h's write_rank_file wrote, read back.
struct RankTrace {
  std::string source;  // the file, for messages
  int rank = 0;
  int world_size = 0;
  std::string host;
  std::string boot_id;  // empty: unknown (the host name decides then)
  std::string device;   // "cpu", "cuda:0"
  std::vector<int64_t> sync_ns;
  int64_t dropped_spans = 0;
  nlohmann::json events;  // the traceEvents array
};

// "DIR/rank-3.json"
std::string rank_trace_path(const std::string& dir, int rank);

// Reads one rank file; IoError when it cannot be read or parsed, InvalidArgument when it is
// not an mtrain rank trace (each naming the file and what was expected).
RankTrace read_rank_trace(const std::string& path);

// How one rank's clock was mapped onto rank 0's.
struct RankAlignment {
  int rank = 0;
  std::string method;        // "same host" (one kernel's clock) or "barriers"
  double offset_us = 0.0;    // subtracted from this rank's clock
  double spread_us = 0.0;    // barriers only: the largest deviation from the median offset
};

// Per rank, over the steps both recorded: what the steps cost and how much of the gradient
// all-reduce backward hid (Note [What the merged trace reports]).
struct RankSummary {
  int rank = 0;
  int64_t steps = 0;
  double step_ms = 0.0;       // mean step
  double compute_ms = 0.0;    // mean forward + backward + optimizer per step
  double sync_wait_ms = 0.0;  // mean wait after backward per step
  double allreduce_ms = 0.0;  // mean first launch to last completion per step
  double hidden = 0.0;        // 1 - sync wait / all-reduce span, over all steps
  int64_t slowest_steps = 0;  // steps in which this rank waited least: the others waited for it
};

struct MergedTrace {
  nlohmann::json file;  // the Chrome trace, ready to dump
  std::vector<RankAlignment> alignment;
  std::vector<RankSummary> summary;
  int64_t spans = 0;
  // Some rank trained on a GPU: its spans are host-side, so the summary leaves out what
  // only a host-side wait can show (Note [What the merged trace reports]).
  bool on_gpu = false;
};

// Merges the ranks of one run: every rank from 0 to the world size once (InvalidArgument
// naming the missing or repeated ranks, or a rank of another world size).
MergedTrace merge_rank_traces(std::vector<RankTrace> ranks);

// Reads DIR's rank files (rank-0.json names the world size), merges them and writes `out`.
MergedTrace merge_trace_dir(const std::string& dir, const std::string& out);

// Writes `merged` to `out` (via a temporary file and a rename); IoError when it cannot.
void write_merged_trace(const MergedTrace& merged, const std::string& out);

// Lines for a person: the alignment and the per-rank summary.
std::vector<std::string> describe_merged_trace(const MergedTrace& merged);

}  // namespace mtrain::trace
