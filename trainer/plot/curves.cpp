#include "trainer/plot/curves.h"

#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace mtrain::plot {

namespace {

// matplotlib's tab10, one per run when runs are compared.
constexpr unsigned kRunColours[] = {0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728, 0x9467bd,
                                    0x8c564b, 0xe377c2, 0x7f7f7f, 0xbcbd22, 0x17becf};

struct Curve {
  const char* label;
  LineStyle style;
  unsigned rgb;  // d2l's 'b-', 'm--', 'g-.'
};
constexpr Curve kCurves[] = {{"train loss", LineStyle::kSolid, 0x1f77b4},
                             {"train acc", LineStyle::kDashed, 0xbf00bf},
                             {"test acc", LineStyle::kDashDot, 0x008000}};

std::vector<Series> curves_of(const std::vector<EpochPoint>& points, const std::string& prefix,
                              const unsigned* colour) {
  std::vector<Series> out;
  for (const Curve& c : kCurves) out.push_back({prefix + c.label, {}, c.style, colour ? *colour : c.rgb});
  const auto add = [](Series& s, double x, double y) {
    if (std::isfinite(x) && std::isfinite(y)) s.points.emplace_back(x, y);
  };
  for (const EpochPoint& p : points) {
    add(out[0], p.epoch, p.train_loss);
    add(out[1], p.epoch, p.train_acc);
    if (p.test_acc) add(out[2], p.epoch, *p.test_acc);
  }
  if (out[2].points.empty()) out.pop_back();  // no evaluation: no test curve in the legend
  return out;
}

}  // namespace

Chart training_curves(const std::string& title, const std::vector<EpochPoint>& points) {
  Chart chart;
  chart.title = title;
  chart.series = curves_of(points, "", nullptr);
  return chart;
}

Chart compare_runs(const std::string& title, const std::vector<std::pair<std::string, std::vector<EpochPoint>>>& runs) {
  Chart chart;
  chart.title = title;
  for (size_t i = 0; i < runs.size(); ++i) {
    const unsigned colour = kRunColours[i % std::size(kRunColours)];
    for (Series& s : curves_of(runs[i].second, runs[i].first + ": ", &colour)) chart.series.push_back(std::move(s));
  }
  return chart;
}

std::vector<EpochPoint> read_epoch_points(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  if (!in) throw IoError(fmt::format("cannot read the metrics file {}", metrics_path));
  std::vector<EpochPoint> points;
  std::vector<double> weights;  // images behind each point
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    const nlohmann::json event = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const auto where = [&] { return fmt::format("{} line {}", metrics_path, number); };
    if (!event.is_object()) {
      throw InvalidArgument(fmt::format("{}: expected a JSON object (a metrics event), found '{:.40}'", where(), line));
    }
    const auto kind = event.find("event");
    if (kind == event.end() || !kind->is_string() || kind->get<std::string>() != "epoch") continue;
    // A non-finite number is written as null (Note [Metrics events]): read back as NaN.
    const auto number_at = [&](const char* key) {
      const auto it = event.find(key);
      if (it != event.end() && it->is_null()) return std::nan("");
      if (it == event.end() || !it->is_number()) {
        throw InvalidArgument(fmt::format("{}: expected a number for \"{}\" in an epoch event", where(), key));
      }
      return it->get<double>();
    };
    EpochPoint p;
    p.epoch = number_at("epoch");
    p.train_loss = number_at("train_loss");
    p.train_acc = number_at("train_acc");
    if (const auto t = event.find("test_acc"); t != event.end() && t->is_number()) p.test_acc = t->get<double>();
    // A run stopped by --max-steps and resumed writes the epoch twice, each event
    // covering its own steps (Note [Resuming mid-epoch]): one point, the training
    // figures weighted by images, the evaluation from the later event.
    const auto images = event.find("images");
    const double n = images != event.end() && images->is_number() ? images->get<double>() : 1.0;
    if (!points.empty() && points.back().epoch == p.epoch) {
      EpochPoint& q = points.back();
      const double total = weights.back() + n;
      q.train_loss = (q.train_loss * weights.back() + p.train_loss * n) / total;
      q.train_acc = (q.train_acc * weights.back() + p.train_acc * n) / total;
      if (p.test_acc) q.test_acc = p.test_acc;
      weights.back() = total;
      continue;
    }
    points.push_back(p);
    weights.push_back(n);
  }
  return points;
}

}  // namespace mtrain::plot
