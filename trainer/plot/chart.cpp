#include "trainer/plot/chart.h"

#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "core/error.h"

namespace mtrain::plot {

namespace {

namespace fs = std::filesystem;

constexpr double kMargin = 12;
constexpr double kFontSize = 12;

// 1, 2 or 5 times a power of ten, at least `raw`.
double nice_step(double raw) {
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

void set_rgb(cairo_t* cr, unsigned rgb) {
  cairo_set_source_rgb(cr, ((rgb >> 16) & 0xff) / 255.0, ((rgb >> 8) & 0xff) / 255.0, (rgb & 0xff) / 255.0);
}

void set_style(cairo_t* cr, LineStyle style) {
  static const double dashed[] = {6, 4};
  static const double dash_dot[] = {7, 3, 2, 3};
  static const double dotted[] = {2, 3};
  switch (style) {
    case LineStyle::kSolid: cairo_set_dash(cr, nullptr, 0, 0); break;
    case LineStyle::kDashed: cairo_set_dash(cr, dashed, 2, 0); break;
    case LineStyle::kDashDot: cairo_set_dash(cr, dash_dot, 4, 0); break;
    case LineStyle::kDotted: cairo_set_dash(cr, dotted, 2, 0); break;
  }
}

double text_width(cairo_t* cr, const std::string& text) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, text.c_str(), &e);
  return e.x_advance;
}

void show_text(cairo_t* cr, const std::string& text, double x, double y) {
  cairo_move_to(cr, x, y);
  cairo_show_text(cr, text.c_str());
}

std::string tick_label(double v, double step) {
  if (step >= 1) return fmt::format("{:.0f}", v);
  const int decimals = static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  return fmt::format("{:.{}f}", v, decimals);
}

void draw_axes(cairo_t* cr, const Chart& chart, const PlotArea& a, int width, int height) {
  cairo_set_line_width(cr, 1);
  cairo_set_dash(cr, nullptr, 0, 0);
  const double y_step = nice_step((a.y_max - a.y_min) / 5);
  for (double y = a.y_min; y <= a.y_max + 1e-9; y += y_step) {
    set_rgb(cr, 0xdddddd);
    cairo_move_to(cr, a.left, std::round(a.py(y)) + 0.5);
    cairo_line_to(cr, a.right, std::round(a.py(y)) + 0.5);
    cairo_stroke(cr);
    set_rgb(cr, 0x333333);
    const std::string label = tick_label(y, y_step);
    show_text(cr, label, a.left - 6 - text_width(cr, label), a.py(y) + kFontSize / 3);
  }
  const double x_step = std::max(1.0, nice_step((a.x_max - a.x_min) / 8));
  for (double x = std::ceil(a.x_min / x_step) * x_step; x <= a.x_max + 1e-9; x += x_step) {
    set_rgb(cr, 0xdddddd);
    cairo_move_to(cr, std::round(a.px(x)) + 0.5, a.top);
    cairo_line_to(cr, std::round(a.px(x)) + 0.5, a.bottom);
    cairo_stroke(cr);
    set_rgb(cr, 0x333333);
    const std::string label = tick_label(x, x_step);
    show_text(cr, label, a.px(x) - text_width(cr, label) / 2, a.bottom + kFontSize + 4);
  }
  set_rgb(cr, 0x333333);
  cairo_rectangle(cr, a.left + 0.5, a.top + 0.5, a.right - a.left, a.bottom - a.top);
  cairo_stroke(cr);
  show_text(cr, chart.x_label, (a.left + a.right) / 2 - text_width(cr, chart.x_label) / 2, height - kMargin / 2);
  cairo_set_font_size(cr, kFontSize + 2);
  show_text(cr, chart.title, width / 2.0 - text_width(cr, chart.title) / 2, kMargin + kFontSize);
  cairo_set_font_size(cr, kFontSize);
}

void draw_series(cairo_t* cr, const Series& s, const PlotArea& a) {
  if (s.points.empty()) return;  // callers leave non-finite points out
  set_rgb(cr, s.rgb);
  set_style(cr, s.style);
  cairo_set_line_width(cr, 2);
  cairo_move_to(cr, a.px(s.points.front().first), a.py(s.points.front().second));
  for (const auto& [x, y] : s.points) cairo_line_to(cr, a.px(x), a.py(y));
  if (s.points.size() == 1) {  // one epoch: a dot, since a line needs two
    cairo_arc(cr, a.px(s.points.front().first), a.py(s.points.front().second), 3, 0, 2 * M_PI);
    cairo_fill(cr);
    return;
  }
  cairo_stroke(cr);
}

// How many of the curves' points (and midpoints) fall inside the box.
int points_inside(const Chart& chart, const PlotArea& a, double x0, double y0, double w, double h) {
  int n = 0;
  const auto inside = [&](double x, double y) {
    const double px = a.px(x), py = a.py(y);
    return px >= x0 && px <= x0 + w && py >= y0 && py <= y0 + h;
  };
  for (const Series& s : chart.series) {
    for (size_t i = 0; i < s.points.size(); ++i) {
      n += inside(s.points[i].first, s.points[i].second);
      if (i + 1 < s.points.size()) {
        n += inside((s.points[i].first + s.points[i + 1].first) / 2, (s.points[i].second + s.points[i + 1].second) / 2);
      }
    }
  }
  return n;
}

// In the corner (or the middle of the right edge) that hides the fewest points of the
// curves, on a white ground so that it stays readable when one passes behind it.
void draw_legend(cairo_t* cr, const Chart& chart, const PlotArea& a) {
  double widest = 0;
  for (const Series& s : chart.series) widest = std::max(widest, text_width(cr, s.label));
  const double line = kFontSize + 6;
  const double box_w = widest + 44, box_h = line * static_cast<double>(chart.series.size()) + 8;
  const double right = a.right - box_w - 8, left = a.left + 8;
  const double top = a.top + 8, bottom = a.bottom - box_h - 8, middle = (a.top + a.bottom - box_h) / 2;
  const std::pair<double, double> places[] = {{right, middle}, {right, top}, {right, bottom}, {left, top},
                                              {left, bottom}};
  auto [x0, y0] = places[0];
  int fewest = points_inside(chart, a, x0, y0, box_w, box_h);
  for (const auto& [x, y] : places) {
    if (const int n = points_inside(chart, a, x, y, box_w, box_h); n < fewest) {
      fewest = n;
      x0 = x;
      y0 = y;
    }
  }
  cairo_set_dash(cr, nullptr, 0, 0);
  cairo_set_source_rgba(cr, 1, 1, 1, 0.85);
  cairo_rectangle(cr, x0, y0, box_w, box_h);
  cairo_fill_preserve(cr);
  set_rgb(cr, 0xaaaaaa);
  cairo_set_line_width(cr, 1);
  cairo_stroke(cr);
  for (size_t i = 0; i < chart.series.size(); ++i) {
    const Series& s = chart.series[i];
    const double y = y0 + 4 + line * (static_cast<double>(i) + 0.5);
    set_rgb(cr, s.rgb);
    set_style(cr, s.style);
    cairo_set_line_width(cr, 2);
    cairo_move_to(cr, x0 + 6, y);
    cairo_line_to(cr, x0 + 32, y);
    cairo_stroke(cr);
    set_rgb(cr, 0x333333);
    show_text(cr, s.label, x0 + 38, y + kFontSize / 3);
  }
}

void draw(cairo_t* cr, const Chart& chart, int width, int height) {
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, kFontSize);
  const PlotArea a = layout(chart, width, height);
  draw_axes(cr, chart, a, width, height);
  cairo_save(cr);
  cairo_rectangle(cr, a.left, a.top, a.right - a.left, a.bottom - a.top);
  cairo_clip(cr);
  for (const Series& s : chart.series) draw_series(cr, s, a);
  cairo_restore(cr);
  draw_legend(cr, chart, a);
}

void check(cairo_status_t status, const std::string& what) {
  if (status != CAIRO_STATUS_SUCCESS) throw IoError(fmt::format("{}: {}", what, cairo_status_to_string(status)));
}

}  // namespace

PlotArea layout(const Chart& chart, int width, int height) {
  PlotArea a;
  a.left = 56;
  a.top = kMargin + kFontSize + 14;
  a.right = width - kMargin - 4;
  a.bottom = height - kMargin - 2 * kFontSize - 6;
  bool any = false;
  double x_lo = 0, x_hi = 0, y_lo = 0, y_hi = 1;
  for (const Series& s : chart.series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x_lo = any ? std::min(x_lo, x) : x;
      x_hi = any ? std::max(x_hi, x) : x;
      y_lo = std::min(y_lo, y);
      y_hi = std::max(y_hi, y);
      any = true;
    }
  }
  a.x_min = any ? x_lo : 1;
  a.x_max = std::max(any ? x_hi : 2, a.x_min + 1);
  const double step = nice_step((y_hi - y_lo) / 5);
  a.y_min = std::floor(y_lo / step) * step;
  a.y_max = std::ceil(y_hi / step - 1e-9) * step;
  return a;
}

void check_chart_path(const std::string& path, const std::string& flag) {
  const std::string ext = fs::path(path).extension().string();
  if (ext != ".png" && ext != ".svg") {
    throw InvalidArgument(
        fmt::format("{}{}: expected a file name ending in .png or .svg", flag.empty() ? "" : flag + " ", path));
  }
}

void write_chart(const Chart& chart, const std::string& path, int width, int height) {
  check_chart_path(path);
  const std::string ext = fs::path(path).extension().string();
  // Drawn next to the target and renamed over it, so a viewer never reads half a file.
  const std::string tmp = path + ".tmp";
  const std::string what = fmt::format("cannot write the chart {}", path);
  // Whatever fails below, no half-written temporary is left behind.
  struct RemoveUnlessRenamed {
    const std::string& file;
    bool renamed = false;
    ~RemoveUnlessRenamed() {
      std::error_code ignored;
      if (!renamed) fs::remove(file, ignored);
    }
  } cleanup{tmp};
  {
    // An SVG surface writes its file as it finishes; an image surface is saved as PNG.
    const bool svg = ext == ".svg";
    const std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> surface(
        svg ? cairo_svg_surface_create(tmp.c_str(), width, height)
            : cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height),
        cairo_surface_destroy);
    check(cairo_surface_status(surface.get()), what);
    {
      const std::unique_ptr<cairo_t, decltype(&cairo_destroy)> cr(cairo_create(surface.get()), cairo_destroy);
      draw(cr.get(), chart, width, height);
      check(cairo_status(cr.get()), what);
    }
    if (!svg) check(cairo_surface_write_to_png(surface.get(), tmp.c_str()), what);
    cairo_surface_finish(surface.get());
    check(cairo_surface_status(surface.get()), what);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw IoError(fmt::format("{}: {}", what, ec.message()));
  cleanup.renamed = true;
}

}  // namespace mtrain::plot
