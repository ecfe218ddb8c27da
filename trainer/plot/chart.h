// Line charts drawn with cairo, d2l's training curves in particular: lines over a
// shared x axis, a legend, a title; written as PNG or SVG (by the file's extension),
// atomically, so a viewer refreshing the file never reads half of it.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace mtrain::plot {

enum class LineStyle { kSolid, kDashed, kDashDot, kDotted };

struct Series {
  std::string label;
  std::vector<std::pair<double, double>> points;  // (x, y), drawn in order
  LineStyle style = LineStyle::kSolid;
  unsigned rgb = 0x1f77b4;  // 0xRRGGBB
};

struct Chart {
  std::string title;
  std::string x_label = "epoch";
  std::vector<Series> series;
};

// Where the data lands in a width x height picture: the plot area's edges in pixels
// and the data range it shows (x from the smallest x to the largest, at least one unit
// wide; y from 0, or the smallest y when negative, up to a round number above the
// largest y and at least 1).
struct PlotArea {
  double left = 0, top = 0, right = 0, bottom = 0;
  double x_min = 0, x_max = 1, y_min = 0, y_max = 1;
  double px(double x) const { return left + (x - x_min) / (x_max - x_min) * (right - left); }
  double py(double y) const { return bottom - (y - y_min) / (y_max - y_min) * (bottom - top); }
};
PlotArea layout(const Chart& chart, int width, int height);

// Throws InvalidArgument unless `path` ends in .png or .svg (the formats write_chart
// knows), naming `flag` (e.g. "--plot") when it is not empty.
void check_chart_path(const std::string& path, const std::string& flag = "");

// Writes `chart` to `path`: .png or .svg, anything else is InvalidArgument; a failure to
// write is IoError naming the path. Series without points are left out of the lines
// but stay in the legend.
void write_chart(const Chart& chart, const std::string& path, int width = 640, int height = 420);

}  // namespace mtrain::plot
