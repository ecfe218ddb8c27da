// d2l's training curves (train loss, train accuracy, test accuracy against epochs) as
// charts: one run as it trains (mtrain-train --plot), or several runs read back from
// their metrics files (mtrain-plot).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainer/plot/chart.h"

namespace mtrain::plot {

struct EpochPoint {
  double epoch = 0;
  double train_loss = 0;
  double train_acc = 0;
  std::optional<double> test_acc;  // absent without evaluation
};

// One run: "train loss" (blue, solid), "train acc" (magenta, dashed) and "test acc"
// (green, dash-dot), as d2l's Animator draws them.
Chart training_curves(const std::string& title, const std::vector<EpochPoint>& points);

// Several runs in one chart: a colour per run, the line style per curve, labels
// "<run>: train loss" and so on.
Chart compare_runs(const std::string& title, const std::vector<std::pair<std::string, std::vector<EpochPoint>>>& runs);

// The "epoch" events of a metrics file (JSON lines, docs/training.md), in file order.
// A file that cannot be read is IoError; a line that is not a JSON object, or an epoch
// event without its numbers, is InvalidArgument naming the file and line.
std::vector<EpochPoint> read_epoch_points(const std::string& metrics_path);

}  // namespace mtrain::plot
