// The --trace timeline: the recorder keeps what it is asked to and no more, rank files read
// back, the merge aligns the ranks' clocks and refuses files that are not one run's, and a real
// 2-rank run's merged file parses, its spans nest on every row and follow a step's order, and
// each bucket's all-reduce completes only after every rank launched it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/trace.h"
#include "tests/trainer/e2e_paths.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "trainer/trace/merge.h"

using namespace mtrain;
using Catch::Matchers::Contains;
using mtrain::testing::TempDir;

namespace {

const std::string kTraceTool = mtrain::testing::bin_dir() + "/mtrain-trace";

trace::Clock::time_point at_ns(int64_t ns) { return trace::Clock::time_point(std::chrono::nanoseconds(ns)); }

// A rank file's contents as write_rank_file makes them: one "step" span at `ts_us`.
// `host` is also the boot id unless one is given.
trace::RankTrace synthetic_rank(int rank, int world, const std::string& host, std::vector<int64_t> sync_ns,
                                double ts_us, const std::string& boot_id = "") {
  trace::RankTrace t;
  t.source = "rank-" + std::to_string(rank) + ".json";
  t.rank = rank;
  t.world_size = world;
  t.host = host;
  t.boot_id = boot_id.empty() ? host : boot_id;
  t.device = "cpu";
  t.sync_ns = std::move(sync_ns);
  t.events = nlohmann::json::array({{{"ph", "X"}, {"name", "step"}, {"pid", rank}, {"tid", 0}, {"ts", ts_us},
                                     {"dur", 100.0}, {"args", {{"step", 1}}}}});
  return t;
}

double step_ts(const nlohmann::json& merged, int rank) {
  for (const auto& e : merged["traceEvents"]) {
    if (e["ph"] == "X" && e["pid"] == rank) return e["ts"].get<double>();
  }
  FAIL("no span of rank " << rank);
  return 0;
}

struct Span {
  std::string name;
  int pid = 0, tid = 0;
  double start = 0, end = 0;
  nlohmann::json args;
};

std::vector<Span> spans_of(const nlohmann::json& file) {
  std::vector<Span> out;
  for (const auto& e : file.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const double ts = e.at("ts").get<double>();
    out.push_back({e.at("name").get<std::string>(), e.at("pid").get<int>(), e.at("tid").get<int>(), ts,
                   ts + e.at("dur").get<double>(), e.value("args", nlohmann::json::object())});
  }
  return out;
}

bool inside(const Span& inner, const Span& outer, double eps = 1e-3) {
  return inner.start >= outer.start - eps && inner.end <= outer.end + eps;
}

}  // namespace

TEST_CASE("the recorder keeps spans only while recording, up to its cap", "[trace]") {
  trace::start(3);
  trace::record("before", "step", trace::kTrainRow, at_ns(0), at_ns(10));
  trace::set_recording(true);
  trace::record("a", "compute", trace::kTrainRow, at_ns(100), at_ns(200), "images", 8);
  { const trace::Span span("b", "comm"); }
  trace::record("c", "comm", trace::bucket_row(2), at_ns(300), at_ns(400));
  trace::record("d", "comm", trace::bucket_row(2), at_ns(500), at_ns(600));  // over the cap
  trace::set_recording(false);
  trace::record("after", "step", trace::kTrainRow, at_ns(700), at_ns(800));
  const auto spans = trace::spans();
  REQUIRE(spans.size() == 3);
  CHECK(std::string(spans[0].name) == "a");
  CHECK(spans[0].arg == 8);
  CHECK(std::string(spans[1].name) == "b");
  CHECK(spans[1].end_ns >= spans[1].start_ns);
  CHECK(spans[2].row == 102);
  CHECK(trace::dropped() == 1);

  TempDir dir;
  const std::string path = dir.file("rank-1.json");
  trace::write_rank_file(path, 1, 2, "cpu", {"host-x", "boot-x", {50, 60}});
  const trace::RankTrace back = trace::read_rank_trace(path);
  CHECK(back.rank == 1);
  CHECK(back.world_size == 2);
  CHECK(back.host == "host-x");
  CHECK(back.boot_id == "boot-x");
  CHECK(back.device == "cpu");
  CHECK(back.sync_ns == std::vector<int64_t>{50, 60});
  CHECK(back.dropped_spans == 1);
  int spans_back = 0;
  std::map<int, std::string> rows;
  for (const auto& e : back.events) {
    if (e["ph"] == "M" && e["name"] == "thread_name") rows[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    ++spans_back;
    if (e["name"] == "a") {
      CHECK(e["ts"].get<double>() == Approx(0.05));  // (100 - 50) ns in microseconds
      CHECK(e["dur"].get<double>() == Approx(0.1));
      CHECK(e["args"]["images"] == 8);
    }
  }
  CHECK(spans_back == 3);
  CHECK(rows[0] == "training thread");
  CHECK(rows[102] == "all-reduce, bucket 2");
  trace::start();  // leave a clean, idle recorder for the other tests
}

TEST_CASE("the merge takes one host's clock as it is and aligns other hosts by the median barrier offset",
          "[trace]") {
  // Rank 1 on another host: its clock reads 5 s ahead of rank 0's; it left the third barrier
  // 900 us late, which the median must ignore. Its step began at the same moment as rank 0's.
  const std::vector<int64_t> sync0{1'000'000, 2'000'000, 3'000'000, 4'000'000, 5'000'000};
  std::vector<int64_t> sync1;
  for (int64_t t : sync0) sync1.push_back(t + 5'000'000'000);
  sync1[2] += 900'000;
  // Rank 2 on rank 0's host: its first reading came 40 us after rank 0's, and its step 40 us +
  // 7 us into its own trace is 47 us into rank 0's.
  std::vector<int64_t> sync2{1'040'000, 2'040'000, 3'040'000, 4'040'000, 5'040'000};
  std::vector<trace::RankTrace> ranks{synthetic_rank(2, 3, "a", sync2, 7.0), synthetic_rank(1, 3, "b", sync1, 10.0),
                                      synthetic_rank(0, 3, "a", sync0, 10.0)};
  const trace::MergedTrace merged = trace::merge_rank_traces(ranks);
  CHECK(step_ts(merged.file, 0) == Approx(10.0));
  CHECK(step_ts(merged.file, 1) == Approx(10.0));
  CHECK(step_ts(merged.file, 2) == Approx(47.0));
  REQUIRE(merged.alignment.size() == 3);
  CHECK(merged.alignment[1].method == "barriers");
  CHECK(merged.alignment[1].offset_us == Approx(5'000'000.0));
  CHECK(merged.alignment[1].spread_us == Approx(900.0));
  CHECK(merged.alignment[2].method == "same host");
  CHECK(merged.file["mtrain"]["world_size"] == 3);

  // One host name on two kernels (containers) is two clocks; two names on one kernel, one.
  const auto twins = trace::merge_rank_traces(
      {synthetic_rank(0, 2, "node", sync0, 10.0, "boot-a"), synthetic_rank(1, 2, "node", sync1, 10.0, "boot-b")});
  CHECK(twins.alignment[1].method == "barriers");
  CHECK(step_ts(twins.file, 1) == Approx(10.0));
  const auto renamed = trace::merge_rank_traces(
      {synthetic_rank(0, 2, "a", sync0, 10.0, "boot-a"), synthetic_rank(1, 2, "b", sync2, 7.0, "boot-a")});
  CHECK(renamed.alignment[1].method == "same host");
  CHECK(step_ts(renamed.file, 1) == Approx(47.0));
}

TEST_CASE("the merge refuses files that are not one whole run", "[trace]") {
  const std::vector<int64_t> sync{1, 2};
  using trace::merge_rank_traces;
  CHECK_THROWS_WITH(merge_rank_traces({synthetic_rank(0, 3, "a", sync, 0), synthetic_rank(2, 3, "a", sync, 0)}),
                    Contains("no file for rank(s) 1"));
  CHECK_THROWS_WITH(merge_rank_traces({synthetic_rank(0, 2, "a", sync, 0), synthetic_rank(0, 2, "a", sync, 0),
                                       synthetic_rank(1, 2, "a", sync, 0)}),
                    Contains("more than one file for rank(s) 0"));
  CHECK_THROWS_WITH(merge_rank_traces({synthetic_rank(0, 2, "a", sync, 0), synthetic_rank(1, 4, "a", sync, 0)}),
                    Contains("rank 1 of a world of 4, not 2"));
  CHECK_THROWS_WITH(merge_rank_traces({synthetic_rank(0, 2, "a", sync, 0), synthetic_rank(1, 2, "b", {1, 2, 3}, 0)}),
                    Contains("expected 2 clock readings as rank 0's file has, found 3"));

  TempDir dir;
  std::ofstream(dir.file("not-json.json")) << "{\"traceEvents\": [";
  CHECK_THROWS_AS(trace::read_rank_trace(dir.file("not-json.json")), IoError);
  std::ofstream(dir.file("chrome.json")) << R"({"traceEvents": []})";
  CHECK_THROWS_WITH(trace::read_rank_trace(dir.file("chrome.json")), Contains("with \"mtrain\", found none"));
  std::ofstream(dir.file("bad-rank.json"))
      << R"({"traceEvents": [], "mtrain": {"rank": 5, "world_size": 2, "host": "a", "clock_sync_ns": [1]}})";
  CHECK_THROWS_WITH(trace::read_rank_trace(dir.file("bad-rank.json")), Contains("found rank 5 of world size 2"));
  CHECK_THROWS_WITH(trace::read_rank_trace(dir.file("missing.json")), Contains("cannot open"));
  const auto tool = mtrain::testing::run_process(kTraceTool, {dir.path()});
  CHECK(tool.exit_code != 0);
  CHECK_THAT(tool.err, Contains("rank-0.json: cannot open"));
}

TEST_CASE("a 2-rank run's timeline nests, follows each step's order and shows every all-reduce after its launches",
          "[trace][e2e]") {
  TempDir dir;
  const std::string traces = dir.file("trace");
  const auto r = mtrain::testing::run_process(
      mtrain::testing::kLauncher,
      {"--nproc_per_node=2", mtrain::testing::kTrainer, "--model", "resnet18", "--sync-bn", "--batch-size", "8",
       "--epochs", "1", "--max-steps", "4", "--threads", "1", "--data-dir", mtrain::testing::kMiniSet,
       "--checkpoint-dir", dir.file("ckpt"), "--trace", traces, "--trace-steps", "2:3"});
  const std::string log = r.out + r.err;
  INFO(log);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(log, Contains("--trace: wrote " + traces + "/trace.json"));
  CHECK_THAT(log, Contains("hidden by backward"));

  const nlohmann::json file = nlohmann::json::parse(mtrain::testing::slurp(traces + "/trace.json"));
  const std::vector<Span> spans = spans_of(file);
  REQUIRE(file["mtrain"]["world_size"] == 2);
  for (const auto& a : file["mtrain"]["clock_alignment"]) CHECK(a["method"] == "same host");

  // Every row of every rank: spans nest or follow one another.
  std::map<std::pair<int, int>, std::vector<Span>> rows;
  for (const Span& s : spans) rows[{s.pid, s.tid}].push_back(s);
  CHECK(rows.size() >= 2 * 4);  // the training thread and resnet18's 3 buckets, per rank
  for (auto& [row, list] : rows) {
    std::sort(list.begin(), list.end(),
              [](const Span& a, const Span& b) { return a.start != b.start ? a.start < b.start : a.end > b.end; });
    std::vector<Span> open;
    for (const Span& s : list) {
      while (!open.empty() && s.start >= open.back().end - 1e-3) open.pop_back();
      INFO("rank " << row.first << " row " << row.second << ": " << s.name << " at " << s.start);
      if (!open.empty()) CHECK(inside(s, open.back()));
      open.push_back(s);
    }
  }

  // Only the steps asked for; evaluation and the checkpoints whenever they happen.
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<int64_t> steps;
    int evaluations = 0, checkpoints = 0;
    for (const Span& s : spans) {
      if (s.pid != rank) continue;
      if (s.name == "step") steps.push_back(s.args["step"].get<int64_t>());
      evaluations += s.name == "evaluation";
      checkpoints += s.name == "checkpoint";
    }
    std::sort(steps.begin(), steps.end());
    CHECK(steps == std::vector<int64_t>{2, 3});
    CHECK(evaluations == 1);
    CHECK(checkpoints == 1);  // the epoch's end, after step 4
  }

  // Within each traced step of each rank: data, forward, backward, the wait, the optimizer, in
  // that order; SyncBatchNorm's collectives inside forward and backward; each bucket's
  // all-reduce launched during backward, done before the wait ends, and done only after every
  // rank launched it.
  std::map<std::tuple<int64_t, int, int>, Span> allreduce;  // (step, bucket, rank)
  for (const Span& step : spans) {
    if (step.name != "step") continue;
    std::map<std::string, Span> first;
    std::vector<Span> in_step;
    for (const Span& s : spans) {
      if (s.pid != step.pid || &s == &step || !inside(s, step) || s.name == "step") continue;
      in_step.push_back(s);
      if (first.count(s.name) == 0) first[s.name] = s;
    }
    INFO("rank " << step.pid << " step " << step.args["step"]);
    for (const char* name : {"data wait", "forward", "backward", "gradient sync wait", "optimizer"}) {
      REQUIRE(first.count(name) == 1);
    }
    CHECK(first["data wait"].end <= first["forward"].start + 1e-3);
    CHECK(first["forward"].end <= first["backward"].start + 1e-3);
    CHECK(first["backward"].end <= first["gradient sync wait"].start + 1e-3);
    CHECK(first["gradient sync wait"].end <= first["optimizer"].start + 1e-3);
    int gathers = 0, reduces = 0, buckets = 0;
    for (const Span& s : in_step) {
      if (s.name == "SyncBatchNorm all-gather") gathers += inside(s, first["forward"]);
      if (s.name == "SyncBatchNorm all-reduce") reduces += inside(s, first["backward"]);
      if (s.name != "all-reduce") continue;
      ++buckets;
      CHECK(s.start >= first["backward"].start);
      CHECK(s.start <= first["backward"].end);
      CHECK(s.end <= first["gradient sync wait"].end + 1e-3);
      allreduce[{step.args["step"].get<int64_t>(), s.tid, s.pid}] = s;
    }
    CHECK(gathers == 17);  // resnet18's 17 BatchNorm2d layers, one all-gather each
    CHECK(reduces == 17);
    CHECK(buckets == 3);
  }
  REQUIRE(allreduce.size() == 2 * 3 * 2);
  for (const auto& [key, s] : allreduce) {
    const auto& [step, bucket, rank] = key;
    const Span& peer = allreduce.at({step, bucket, 1 - rank});
    INFO("step " << step << " bucket row " << bucket << " rank " << rank);
    CHECK(s.end >= peer.start - 1e-3);
  }

  // The merge command reproduces the run's own merge.
  const auto tool = mtrain::testing::run_process(kTraceTool, {traces, "-o", dir.file("again.json")});
  INFO(tool.err);
  REQUIRE(tool.exit_code == 0);
  CHECK_THAT(tool.out, Contains("2 ranks"));
  const nlohmann::json again = nlohmann::json::parse(mtrain::testing::slurp(dir.file("again.json")));
  CHECK(again["traceEvents"] == file["traceEvents"]);
}

TEST_CASE("a trace that cannot be written costs the run nothing", "[trace][e2e]") {
  const auto r = mtrain::testing::run_process(
      mtrain::testing::kTrainer, {"--model", "mlp", "--max-steps", "2", "--no-eval", "--trace", "/proc/mtrain-trace"});
  const std::string log = r.out + r.err;
  INFO(log);
  CHECK(r.exit_code == 0);
  CHECK_THAT(log, Contains("--trace /proc/mtrain-trace: rank 0 cannot create the directory"));
  CHECK_THAT(log, Contains("training ended at step 2"));
  const auto nothing = mtrain::testing::run_process(mtrain::testing::kTrainer,
                                                    {"--max-steps", "0", "--no-eval", "--trace", "/proc/mtrain-trace"});
  CHECK(nothing.exit_code == 0);
  CHECK_THAT(nothing.out + nothing.err, Contains("--max-steps 0 trains no step, so no timeline is written"));
}

TEST_CASE("--trace-steps takes FIRST:LAST", "[trace]") {
  const auto r = mtrain::testing::run_process(mtrain::testing::kTrainer, {"--trace", "t", "--trace-steps", "5"});
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.err, Contains("--trace-steps: expected FIRST:LAST (optimizer steps, e.g. 11:30), found '5'"));
  const auto backwards =
      mtrain::testing::run_process(mtrain::testing::kTrainer, {"--trace", "t", "--trace-steps", "5:2"});
  CHECK(backwards.exit_code != 0);
  CHECK_THAT(backwards.err, Contains("expected FIRST <= LAST, found 5:2"));
}
