// mtrain-trace: merges the rank files of an mtrain-train --trace run into one timeline
// (docs/training.md, "A timeline of the steps"). mtrain-train does this itself when every
// rank wrote into one directory; after a run over several hosts, gather their files first.
//
//   mtrain-trace runs/trace                     -> runs/trace/trace.json
//   mtrain-trace -o all.json host0/rank-0.json host1/rank-1.json
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <cxxopts.hpp>
#include <fmt/format.h>

#include "core/error.h"
#include "core/main_guard.h"
#include "trainer/trace/merge.h"

int main(int argc, char** argv) {
  return mtrain::run_main("mtrain-trace", [&] {
    cxxopts::Options spec("mtrain-trace", "Merges the per-rank files of mtrain-train --trace into one Chrome trace "
                                          "(Perfetto, chrome://tracing) with the ranks' clocks aligned.");
    spec.add_options()("o,output", "the merged file (default: DIR/trace.json when given one directory)",
                       cxxopts::value<std::string>())(
        "inputs", "a --trace directory, or rank files", cxxopts::value<std::vector<std::string>>())("h,help",
                                                                                                    "this text");
    spec.parse_positional({"inputs"});
    spec.positional_help("DIR | RANK.json...");
    cxxopts::ParseResult r;
    try {
      r = spec.parse(argc, argv);
    } catch (const cxxopts::exceptions::exception& e) {
      throw mtrain::InvalidArgument(fmt::format("{} (see --help)", e.what()));
    }
    if (r.count("help") != 0) {
      std::fputs(spec.help().c_str(), stdout);
      return 0;
    }
    if (r.count("inputs") == 0) throw mtrain::InvalidArgument("expected a --trace directory or rank files, found none");
    const auto inputs = r["inputs"].as<std::vector<std::string>>();
    mtrain::trace::MergedTrace merged;
    std::string out;
    std::error_code ec;
    if (inputs.size() == 1 && std::filesystem::is_directory(inputs.front(), ec)) {
      out = r.count("output") ? r["output"].as<std::string>()
                              : (std::filesystem::path(inputs.front()) / "trace.json").string();
      merged = mtrain::trace::merge_trace_dir(inputs.front(), out);
    } else {
      if (r.count("output") == 0) throw mtrain::InvalidArgument("expected -o FILE with rank files, found none");
      out = r["output"].as<std::string>();
      std::vector<mtrain::trace::RankTrace> ranks;
      for (const std::string& file : inputs) ranks.push_back(mtrain::trace::read_rank_trace(file));
      merged = mtrain::trace::merge_rank_traces(std::move(ranks));
      mtrain::trace::write_merged_trace(merged, out);
    }
    std::printf("mtrain-trace: wrote %s (%lld spans from %zu ranks)\n", out.c_str(),
                static_cast<long long>(merged.spans), merged.summary.size());
    for (const std::string& line : mtrain::trace::describe_merged_trace(merged)) std::printf("  %s\n", line.c_str());
    return 0;
  });
}
