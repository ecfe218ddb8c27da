// Training curves: the pictures decode at the asked size and carry each curve where the
// layout puts its points; metrics files read back; mtrain-train --plot and mtrain-plot
// write what they say.
#include <catch2/catch.hpp>

#include <cairo.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "core/error.h"
#include "tests/trainer/run_process.h"
#include "tests/trainer/temp_dir.h"
#include "trainer/plot/curves.h"

using namespace mtrain::plot;
using Catch::Matchers::Contains;
using mtrain::testing::TempDir;

namespace {

const std::string kBin = MTRAIN_BIN_DIR;
const std::string kMiniSet = std::string(MTRAIN_SOURCE_DIR) + "/data/fashion-mnist-mini";

using Surface = std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)>;

Surface decode_png(const std::string& path) {
  Surface s(cairo_image_surface_create_from_png(path.c_str()), cairo_surface_destroy);
  REQUIRE(cairo_surface_status(s.get()) == CAIRO_STATUS_SUCCESS);
  return s;
}

unsigned pixel(cairo_surface_t* s, int x, int y) {
  cairo_surface_flush(s);
  const unsigned char* row = cairo_image_surface_get_data(s) + y * cairo_image_surface_get_stride(s);
  return reinterpret_cast<const uint32_t*>(row)[x] & 0xffffff;
}

// The colour nearest to `rgb` within `radius` pixels of (x, y), as a distance (0: found).
int nearest_colour_distance(cairo_surface_t* s, double x, double y, unsigned rgb, int radius) {
  int best = 1 << 30;
  for (int dy = -radius; dy <= radius; ++dy) {
    for (int dx = -radius; dx <= radius; ++dx) {
      const unsigned p = pixel(s, static_cast<int>(std::lround(x)) + dx, static_cast<int>(std::lround(y)) + dy);
      int d = 0;
      for (int shift : {0, 8, 16}) d += std::abs(static_cast<int>((p >> shift) & 0xff) - static_cast<int>((rgb >> shift) & 0xff));
      best = std::min(best, d);
    }
  }
  return best;
}

std::vector<EpochPoint> sample_run() {
  return {{1, 1.4, 0.52, 0.61}, {2, 0.78, 0.71, 0.77}, {3, 0.57, 0.79, 0.79}, {4, 0.49, 0.83, 0.82},
          {5, 0.45, 0.84, 0.80}, {6, 0.44, 0.84, 0.83}};
}

}  // namespace

TEST_CASE("a PNG chart decodes at its size and draws each curve through its points", "[plot]") {
  TempDir dir;
  const std::string path = dir.file("curves.png");
  const Chart chart = training_curves("mlp, 1 rank x batch 256, lr 0.1", sample_run());
  REQUIRE(chart.series.size() == 3);
  write_chart(chart, path, 640, 420);
  const Surface png = decode_png(path);
  CHECK(cairo_image_surface_get_width(png.get()) == 640);
  CHECK(cairo_image_surface_get_height(png.get()) == 420);
  const PlotArea area = layout(chart, 640, 420);
  CHECK(area.x_min == 1);
  CHECK(area.x_max == 6);
  CHECK(area.y_min == 0);
  CHECK(area.y_max >= 1.4);
  // Every point of every curve has its curve's colour within two pixels (the legend
  // sits where it hides the fewest points, never on all of them).
  int matched = 0, points = 0;
  for (const Series& s : chart.series) {
    for (const auto& [x, y] : s.points) {
      ++points;
      if (nearest_colour_distance(png.get(), area.px(x), area.py(y), s.rgb, 2) < 60) ++matched;
    }
  }
  CHECK(matched >= points - 2);
  // Far from every curve and below the legend (it takes a corner free of points, and
  // the top one comes first), the ground is white or a grid line.
  const unsigned ground = pixel(png.get(), static_cast<int>(area.px(5.5)), static_cast<int>(area.py(0.12)));
  CHECK((ground == 0xffffff || ground == 0xdddddd));
}

TEST_CASE("SVG, the file name's extension, and an unwritable place", "[plot]") {
  TempDir dir;
  const std::string svg = dir.file("curves.svg");
  write_chart(training_curves("t", sample_run()), svg);
  std::ifstream in(svg);
  std::stringstream text;
  text << in.rdbuf();
  CHECK_THAT(text.str(), Contains("<svg") && Contains("</svg>"));
  CHECK_THROWS_WITH(write_chart(training_curves("t", sample_run()), dir.file("curves.jpg")),
                    Contains("expected a file name ending in .png or .svg"));
  CHECK_THROWS_AS(write_chart(training_curves("t", sample_run()), dir.file("missing/dir/c.png")), mtrain::IoError);
}

TEST_CASE("metrics files read back as epoch points; a broken line is named", "[plot]") {
  TempDir dir;
  const std::string good = dir.file("m.jsonl");
  std::ofstream(good) << R"({"event":"step","step":20,"loss":1.2})" "\n"
                      << R"({"event":"epoch","epoch":1,"train_loss":0.9,"train_acc":0.7,"test_acc":0.75})" "\n"
                      << R"({"event":"epoch","epoch":2,"train_loss":null,"train_acc":0.8,"test_acc":null})" "\n";
  const auto points = read_epoch_points(good);
  REQUIRE(points.size() == 2);
  CHECK(points[0].test_acc == 0.75);
  CHECK(std::isnan(points[1].train_loss));
  CHECK_FALSE(points[1].test_acc.has_value());
  // The non-finite loss is left out of the curve, not drawn.
  const Chart chart = training_curves("t", points);
  CHECK(chart.series[0].points.size() == 1);
  CHECK(chart.series[1].points.size() == 2);

  // An epoch cut by --max-steps and finished after a resume: one point, weighted by images.
  const std::string resumed = dir.file("resumed.jsonl");
  std::ofstream(resumed) << R"({"event":"epoch","epoch":1,"images":100,"train_loss":2.0,"train_acc":0.2,"test_acc":0.3})" "\n"
                         << R"({"event":"epoch","epoch":1,"images":300,"train_loss":1.0,"train_acc":0.6,"test_acc":0.5})" "\n"
                         << R"({"event":"epoch","epoch":2,"images":400,"train_loss":0.8,"train_acc":0.7,"test_acc":0.6})" "\n"
                         << R"({"event":7})" "\n";
  const auto merged = read_epoch_points(resumed);
  REQUIRE(merged.size() == 2);
  CHECK(merged[0].train_loss == Approx(1.25));
  CHECK(merged[0].train_acc == Approx(0.5));
  CHECK(merged[0].test_acc == 0.5);

  const std::string bad = dir.file("bad.jsonl");
  std::ofstream(bad) << R"({"event":"epoch","epoch":1,"train_loss":0.9,"train_acc":0.7})" "\n" << "not json\n";
  CHECK_THROWS_WITH(read_epoch_points(bad), Contains("bad.jsonl line 2: expected a JSON object"));
  const std::string missing = dir.file("missing.jsonl");
  std::ofstream(missing) << R"({"event":"epoch","epoch":1,"train_acc":0.7})" "\n";
  CHECK_THROWS_WITH(read_epoch_points(missing), Contains("line 1: expected a number for \"train_loss\""));
  CHECK_THROWS_AS(read_epoch_points(dir.file("none.jsonl")), mtrain::IoError);
}

TEST_CASE("mtrain-train --plot draws the run's own curves; mtrain-plot compares runs", "[plot][e2e]") {
  TempDir dir;
  const std::string png = dir.file("run.png"), metrics = dir.file("run.jsonl");
  const auto r = mtrain::testing::run_process(
      kBin + "/mtrain-train", {"--model", "mlp", "--epochs", "2", "--data-dir", kMiniSet, "--plot", png, "--metrics",
                               metrics, "--log-every", "1000"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const Surface drawn = decode_png(png);
  CHECK(cairo_image_surface_get_width(drawn.get()) == 640);
  // The curves are the run's: green runs along the line between the two epochs' test
  // accuracies from its metrics (most of it: the legend may cover a stretch).
  const auto points = read_epoch_points(metrics);
  REQUIRE(points.size() == 2);
  REQUIRE(points[0].test_acc.has_value());
  REQUIRE(points[1].test_acc.has_value());
  const Chart chart = training_curves("", points);
  const PlotArea area = layout(chart, 640, 420);
  int green = 0;
  for (int i = 0; i <= 10; ++i) {
    const double t = i / 10.0;
    const double x = points[0].epoch + t * (points[1].epoch - points[0].epoch);
    const double y = *points[0].test_acc + t * (*points[1].test_acc - *points[0].test_acc);
    green += nearest_colour_distance(drawn.get(), area.px(x), area.py(y), chart.series[2].rgb, 2) < 60;
  }
  CHECK(green >= 7);
  const std::string other = dir.file("other.jsonl");
  std::ofstream(other) << R"({"event":"epoch","epoch":1,"train_loss":1.9,"train_acc":0.4,"test_acc":0.5})" "\n";
  const std::string compared = dir.file("compare.svg");
  const auto p = mtrain::testing::run_process(kBin + "/mtrain-plot", {"-o", compared, metrics, other});
  INFO(p.err);
  REQUIRE(p.exit_code == 0);
  CHECK_THAT(p.out, Contains("wrote " + compared + " (2 runs)"));
  std::ifstream in(compared);
  std::stringstream text;
  text << in.rdbuf();
  CHECK_THAT(text.str(), Contains("<svg"));
  // Bad input: one line, exit 2.
  const auto wrong = mtrain::testing::run_process(kBin + "/mtrain-train", {"--plot", dir.file("x.gif"), "--max-steps", "1"});
  CHECK(wrong.exit_code == 2);
  CHECK_THAT(wrong.err, Contains("--plot") && Contains("expected a file name ending in .png or .svg"));
  CHECK(mtrain::testing::run_process(kBin + "/mtrain-plot", {"-o", dir.file("y.png")}).exit_code == 2);
}
