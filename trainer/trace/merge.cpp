#include "trainer/trace/merge.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/files.h"
#include "core/trace.h"

namespace mtrain::trace {

namespace {

const nlohmann::json& require(const nlohmann::json& object, const char* key, const std::string& source) {
  if (!object.is_object() || !object.contains(key)) {
    throw InvalidArgument(fmt::format("{}: expected an mtrain --trace rank file with \"{}\", found none", source, key));
  }
  return object.at(key);
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Note [Aligning the ranks' clocks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every rank stamps its spans with its own steady clock (CLOCK_MONOTONIC). Ranks on one host
// share that clock, so their spans need no correction beyond a common origin: the alignment is
// exact. "One host" means one running kernel, told by its boot id rather than by host names,
// which containers may repeat; only files without a boot id fall back to the host name. Ranks
// on other hosts have clocks with unrelated origins. Before training, every rank
// passes a series of barriers and reads its clock as each one returns (kClockSyncRounds in
// run_trace.cpp); a barrier returns on all ranks at nearly the same moment, so reading i of rank r
// minus reading i of rank 0 estimates their clocks' offset, off by that round's exit skew (the
// network's latency, or a rank descheduled just then). The median over the rounds discards the
// rounds a rank was late for; the spread (the largest deviation from the median) is reported with
// it, as the alignment's error bar. What the median cannot remove is a bias common to every
// round (a barrier that releases rank 0 one network latency before the others), so the true
// error can exceed the spread by about that latency. Steady clocks drift by parts per million,
// so over a short trace the offset is constant.
RankAlignment align(const RankTrace& rank, const RankTrace& reference) {
  RankAlignment a;
  a.rank = rank.rank;
  const bool same_kernel = !rank.boot_id.empty() && !reference.boot_id.empty()
                               ? rank.boot_id == reference.boot_id
                               : rank.host == reference.host;
  if (same_kernel) {
    a.method = "same host";
    return a;
  }
  if (rank.sync_ns.size() != reference.sync_ns.size()) {
    throw InvalidArgument(fmt::format("{}: expected {} clock readings as rank 0's file has, found {}", rank.source,
                                      reference.sync_ns.size(), rank.sync_ns.size()));
  }
  std::vector<double> offsets;
  for (size_t i = 0; i < rank.sync_ns.size(); ++i) {
    offsets.push_back(static_cast<double>(rank.sync_ns[i] - reference.sync_ns[i]) / 1e3);
  }
  a.method = "barriers";
  a.offset_us = median(offsets);
  for (double o : offsets) a.spread_us = std::max(a.spread_us, std::abs(o - a.offset_us));
  return a;
}

struct Interval {
  double start = 0.0;
  double end = 0.0;
};

// Note [What the merged trace reports]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The picture answers two questions a person asks of a data-parallel step, and the summary
// prints the same answers in numbers, per rank, over the traced steps. How much communication
// did backward hide: of the span from a step's first bucket launch to its last bucket's
// completion, the share the rank did not spend in "gradient sync wait". Which rank did each step
// wait for: the rank that waited least after backward was the last to finish it (its peers waited
// for it), as Note [Every rank's wait] in ddp/step_exchange.cpp reasons; the summary counts the steps each
// rank was that one. On a GPU neither is visible from the host: the buckets are awaited on the
// stream (Note [Reducer on a GPU]), so the wait after backward holds no communication and the
// compute spans end when the host queued the kernels, not when they ran; the summary then gives
// the step times only.
std::vector<RankSummary> summarize(const nlohmann::json& events, int world) {
  std::vector<RankSummary> out(static_cast<size_t>(world));
  std::vector<std::map<int64_t, Interval>> steps(static_cast<size_t>(world));
  for (const auto& e : events) {
    if (e.value("ph", "") != "X" || e.value("name", "") != "step") continue;
    const int r = e.at("pid").get<int>();
    const double ts = e.at("ts").get<double>();
    steps[r][e.at("args").at("step").get<int64_t>()] = {ts, ts + e.at("dur").get<double>()};
  }
  std::vector<std::vector<std::pair<double, int64_t>>> step_starts(static_cast<size_t>(world));  // (start, step)
  for (int r = 0; r < world; ++r) {
    for (const auto& [step, span] : steps[r]) step_starts[r].emplace_back(span.start, step);
    std::sort(step_starts[r].begin(), step_starts[r].end());
  }
  // Per rank and step: wait after backward, compute, first launch, last completion.
  struct StepFigures {
    double wait = 0.0, compute = 0.0;
    double first_launch = 1e300, last_done = -1e300;
  };
  std::vector<std::map<int64_t, StepFigures>> figures(static_cast<size_t>(world));
  for (const auto& e : events) {
    if (e.value("ph", "") != "X") continue;
    const int r = e.at("pid").get<int>();
    const double ts = e.at("ts").get<double>(), dur = e.at("dur").get<double>();
    const std::string name = e.at("name").get<std::string>();
    // The step whose span holds this span's start: the last step starting at or before it.
    const auto& starts = step_starts[r];
    auto it = std::upper_bound(starts.begin(), starts.end(), std::make_pair(ts, INT64_MAX));
    if (it == starts.begin()) continue;
    const int64_t step = std::prev(it)->second;
    if (ts > steps[r][step].end) continue;
    StepFigures& f = figures[r][step];
    if (name == "gradient sync wait") f.wait += dur;
    if (name == "forward" || name == "backward" || name == "loss read" || name == "optimizer") f.compute += dur;
    if (name == "all-reduce") {
      f.first_launch = std::min(f.first_launch, ts);
      f.last_done = std::max(f.last_done, ts + dur);
    }
  }
  std::map<int64_t, std::pair<double, int>> least_wait;  // step -> (wait, rank)
  for (int r = 0; r < world; ++r) {
    RankSummary& s = out[r];
    s.rank = r;
    double wait_with_comm = 0.0, comm = 0.0;
    for (const auto& [step, span] : steps[r]) {
      const StepFigures& f = figures[r][step];
      ++s.steps;
      s.step_ms += (span.end - span.start) / 1e3;
      s.compute_ms += f.compute / 1e3;
      s.sync_wait_ms += f.wait / 1e3;
      if (f.last_done > f.first_launch) {
        s.allreduce_ms += (f.last_done - f.first_launch) / 1e3;
        comm += f.last_done - f.first_launch;
        wait_with_comm += f.wait;
      }
      auto [it, fresh] = least_wait.try_emplace(step, f.wait, r);
      if (!fresh && f.wait < it->second.first) it->second = {f.wait, r};
    }
    if (s.steps > 0) {
      const double n = static_cast<double>(s.steps);
      s.step_ms /= n;
      s.compute_ms /= n;
      s.sync_wait_ms /= n;
      s.allreduce_ms /= n;
    }
    s.hidden = comm > 0 ? std::clamp(1.0 - wait_with_comm / comm, 0.0, 1.0) : 0.0;
  }
  for (const auto& [step, least] : least_wait) ++out[least.second].slowest_steps;
  return out;
}

}  // namespace

std::string rank_trace_path(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / fmt::format("rank-{}.json", rank)).string();
}

RankTrace read_rank_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json file;
  try {
    file = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    throw IoError(fmt::format("{}: expected JSON, found a parse error: {}", path, e.what()));
  }
  RankTrace t;
  t.source = path;
  try {
    const nlohmann::json& meta = require(file, "mtrain", path);
    t.rank = require(meta, "rank", path).get<int>();
    t.world_size = require(meta, "world_size", path).get<int>();
    t.host = require(meta, "host", path).get<std::string>();
    t.boot_id = meta.value("boot_id", std::string());
    t.device = meta.value("device", std::string("cpu"));
    t.sync_ns = require(meta, "clock_sync_ns", path).get<std::vector<int64_t>>();
    t.dropped_spans = meta.value("dropped_spans", int64_t{0});
    t.events = require(file, "traceEvents", path);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: a field of the mtrain rank trace has the wrong type: {}", path, e.what()));
  }
  if (t.world_size < 1 || t.rank < 0 || t.rank >= t.world_size || t.sync_ns.empty() || !t.events.is_array()) {
    throw InvalidArgument(fmt::format("{}: expected rank in [0, world size), clock readings and an event array; found "
                                      "rank {} of world size {}, {} clock readings",
                                      path, t.rank, t.world_size, t.sync_ns.size()));
  }
  return t;
}

MergedTrace merge_rank_traces(std::vector<RankTrace> ranks) {
  if (ranks.empty()) throw InvalidArgument("expected rank trace files to merge, found none");
  std::sort(ranks.begin(), ranks.end(), [](const RankTrace& a, const RankTrace& b) { return a.rank < b.rank; });
  const int world = ranks.front().world_size;
  std::vector<std::string> problems;
  for (const RankTrace& t : ranks) {
    if (t.world_size != world) {
      problems.push_back(fmt::format("{} is rank {} of a world of {}, not {}", t.source, t.rank, t.world_size, world));
    }
  }
  std::vector<int> missing, repeated;
  for (int r = 0; r < world; ++r) {
    const auto n = std::count_if(ranks.begin(), ranks.end(), [r](const RankTrace& t) { return t.rank == r; });
    if (n == 0) missing.push_back(r);
    if (n > 1) repeated.push_back(r);
  }
  if (!missing.empty()) problems.push_back(fmt::format("no file for rank(s) {}", fmt::join(missing, ", ")));
  if (!repeated.empty())
    problems.push_back(fmt::format("more than one file for rank(s) {}", fmt::join(repeated, ", ")));
  if (!problems.empty()) {
    throw InvalidArgument(fmt::format("expected one trace file per rank 0..{} of one run; {}", world - 1,
                                      fmt::join(problems, "; ")));
  }

  MergedTrace merged;
  const RankTrace& reference = ranks.front();
  nlohmann::json metadata = nlohmann::json::array(), spans = nlohmann::json::array();
  int64_t dropped = 0;
  for (const RankTrace& t : ranks) {
    const RankAlignment a = align(t, reference);
    merged.on_gpu = merged.on_gpu || t.device.rfind("cuda", 0) == 0;
    merged.alignment.push_back(a);
    dropped += t.dropped_spans;
    // The rank's times count from its first reading; rank 0's first reading is the origin.
    const double shift_us = static_cast<double>(t.sync_ns.front() - reference.sync_ns.front()) / 1e3 - a.offset_us;
    for (nlohmann::json e : t.events) {
      if (!e.is_object() || !e.contains("ph")) {
        throw InvalidArgument(fmt::format("{}: expected trace events with \"ph\", found {}", t.source, e.dump()));
      }
      e["pid"] = t.rank;
      if (e["ph"] == "M") {
        metadata.push_back(std::move(e));
        continue;
      }
      if (!e.contains("ts") || !e["ts"].is_number() || !e.contains("dur") || !e["dur"].is_number()) {
        throw InvalidArgument(fmt::format("{}: expected spans with numeric \"ts\" and \"dur\", found {}", t.source,
                                          e.dump()));
      }
      e["ts"] = e["ts"].get<double>() + shift_us;
      spans.push_back(std::move(e));
    }
  }
  std::stable_sort(spans.begin(), spans.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
    const double ta = a["ts"].get<double>(), tb = b["ts"].get<double>();
    // An enclosing span first when two start together, so viewers nest them.
    return ta != tb ? ta < tb : a["dur"].get<double>() > b["dur"].get<double>();
  });
  try {
    merged.summary = summarize(spans, world);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("expected spans as mtrain-train --trace writes them (names, a step number on "
                                      "each \"step\"), found one that is not: {}",
                                      e.what()));
  }
  merged.spans = static_cast<int64_t>(spans.size());
  nlohmann::json alignment = nlohmann::json::array(), summary = nlohmann::json::array();
  for (const RankAlignment& a : merged.alignment) {
    alignment.push_back(
        {{"rank", a.rank}, {"method", a.method}, {"offset_us", a.offset_us}, {"spread_us", a.spread_us}});
  }
  for (const RankSummary& s : merged.summary) {
    summary.push_back({{"rank", s.rank},
                       {"steps", s.steps},
                       {"step_ms", s.step_ms},
                       {"compute_ms", s.compute_ms},
                       {"sync_wait_ms", s.sync_wait_ms},
                       {"allreduce_ms", s.allreduce_ms},
                       {"hidden", s.hidden},
                       {"slowest_steps", s.slowest_steps}});
  }
  for (auto& e : spans) metadata.push_back(std::move(e));
  merged.file = {{"traceEvents", std::move(metadata)},
                 {"displayTimeUnit", "ms"},
                 {"mtrain", {{"format", 1},
                             {"world_size", world},
                             {"clock_alignment", alignment},
                             {"summary", summary},
                             {"dropped_spans", dropped},
                             {"host_side_only", merged.on_gpu}}}};
  return merged;
}

MergedTrace merge_trace_dir(const std::string& dir, const std::string& out) {
  const RankTrace first = read_rank_trace(rank_trace_path(dir, 0));
  std::vector<RankTrace> ranks{first};
  for (int r = 1; r < first.world_size; ++r) {
    const std::string path = rank_trace_path(dir, r);
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) {
      throw InvalidArgument(fmt::format("{}: expected rank {}'s trace (rank 0's names a world of {}), found no file; "
                                        "copy it from its host, then run mtrain-trace {}",
                                        path, r, first.world_size, dir));
    }
    ranks.push_back(read_rank_trace(path));
  }
  MergedTrace merged = merge_rank_traces(std::move(ranks));
  write_merged_trace(merged, out);
  return merged;
}

void write_merged_trace(const MergedTrace& merged, const std::string& out) {
  replace_file(out, merged.file.dump() + "\n");
}

std::vector<std::string> describe_merged_trace(const MergedTrace& merged) {
  std::vector<std::string> lines;
  for (const RankAlignment& a : merged.alignment) {
    if (a.method == "barriers") {
      lines.push_back(fmt::format("rank {}: clock aligned to rank 0's by barriers, offset {:.1f} us (+/- {:.1f} us)",
                                  a.rank, a.offset_us, a.spread_us));
    }
  }
  for (const RankSummary& s : merged.summary) {
    if (s.steps == 0) {
      lines.push_back(fmt::format("rank {}: no step traced", s.rank));
      continue;
    }
    if (merged.on_gpu) {
      lines.push_back(fmt::format("rank {}: {} steps, {:.1f} ms per step (on a GPU the spans are the host's: see the "
                                  "device's own profiler for kernel times)",
                                  s.rank, s.steps, s.step_ms));
      continue;
    }
    std::string line = fmt::format("rank {}: {} steps, {:.1f} ms per step, {:.1f} ms compute, {:.1f} ms waiting after "
                                   "backward",
                                   s.rank, s.steps, s.step_ms, s.compute_ms, s.sync_wait_ms);
    if (s.allreduce_ms > 0) {
      line += fmt::format("; the all-reduces spanned {:.1f} ms from first launch to last completion, {:.0f}% of it "
                          "hidden by backward",
                          s.allreduce_ms, 100.0 * s.hidden);
    }
    if (merged.summary.size() > 1) line += fmt::format("; the slowest rank in {} of them", s.slowest_steps);
    lines.push_back(line);
  }
  return lines;
}

}  // namespace mtrain::trace
