// mtrain-plot: training curves from metrics files, one run or several in one chart
// (docs/training.md, "Training curves").
//
//   mtrain-plot -o curves.png run.jsonl
//   mtrain-plot -o compare.svg --title "lr 0.1 vs 0.05" lr01.jsonl lr005.jsonl
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <cxxopts.hpp>
#include <fmt/format.h>

#include "core/error.h"
#include "core/main_guard.h"
#include "trainer/plot/curves.h"

int main(int argc, char** argv) {
  return mtrain::run_main("mtrain-plot", [&] {
    cxxopts::Options spec("mtrain-plot", "Draws d2l's training curves (train loss, train and test accuracy per epoch) "
                                         "from mtrain-train --metrics files; several files share one chart.");
    spec.add_options()("o,output", "the picture: a .png or .svg file", cxxopts::value<std::string>())(
        "title", "the chart's title (default: the files' names)", cxxopts::value<std::string>())(
        "width", "pixels", cxxopts::value<int>()->default_value("640"))(
        "height", "pixels", cxxopts::value<int>()->default_value("420"))(
        "files", "metrics files", cxxopts::value<std::vector<std::string>>())("h,help", "this text");
    spec.parse_positional({"files"});
    spec.positional_help("METRICS.jsonl...");
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
    if (r.count("output") == 0) throw mtrain::InvalidArgument("expected -o FILE.png or -o FILE.svg, found none");
    if (r.count("files") == 0) throw mtrain::InvalidArgument("expected one or more metrics files, found none");
    const int width = r["width"].as<int>(), height = r["height"].as<int>();
    if (width < 200 || height < 150 || width > 10000 || height > 10000) {
      throw mtrain::InvalidArgument(
          fmt::format("--width/--height: expected 200..10000 x 150..10000 pixels, found {} x {}", width, height));
    }
    std::vector<std::pair<std::string, std::vector<mtrain::plot::EpochPoint>>> runs;
    std::string names;
    for (const std::string& file : r["files"].as<std::vector<std::string>>()) {
      auto points = mtrain::plot::read_epoch_points(file);
      if (points.empty()) throw mtrain::InvalidArgument(fmt::format("{}: expected epoch events, found none", file));
      const std::string name = std::filesystem::path(file).stem().string();
      names += (names.empty() ? "" : ", ") + name;
      runs.emplace_back(name, std::move(points));
    }
    const std::string title = r.count("title") ? r["title"].as<std::string>() : names;
    const auto chart = runs.size() == 1 ? mtrain::plot::training_curves(title, runs.front().second)
                                        : mtrain::plot::compare_runs(title, runs);
    const std::string out = r["output"].as<std::string>();
    mtrain::plot::write_chart(chart, out, width, height);
    std::printf("mtrain-plot: wrote %s (%zu run%s)\n", out.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
    return 0;
  });
}
