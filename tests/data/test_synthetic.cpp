#include <catch2/catch.hpp>

#include <vector>

#include "core/error.h"
#include "data/synthetic.h"

using namespace mtrain::data;

TEST_CASE("Synthetic data is Fashion-MNIST shaped and sized as asked", "[data][synthetic]") {
  const DatasetSplits s = make_synthetic_splits({.train_size = 300, .test_size = 50, .seed = 1});
  CHECK(s.train.size() == 300);
  CHECK(s.test.size() == 50);
  CHECK(s.train.shape() == ImageShape{1, 28, 28});
  CHECK(s.train.num_classes() == 10);
  CHECK(s.train.name() == "synthetic/train");
  CHECK(s.test.name() == "synthetic/test");
  CHECK_THROWS_AS(make_synthetic_splits({.train_size = 0, .test_size = 5, .seed = 1}),
                  mtrain::InvalidArgument);
}

TEST_CASE("Synthetic data is deterministic for a seed and differs across seeds",
          "[data][synthetic]") {
  const DatasetSplits a = make_synthetic_splits({.train_size = 200, .test_size = 40, .seed = 7});
  const DatasetSplits b = make_synthetic_splits({.train_size = 200, .test_size = 40, .seed = 7});
  const DatasetSplits c = make_synthetic_splits({.train_size = 200, .test_size = 40, .seed = 8});
  CHECK(a.train.pixels() == b.train.pixels());
  CHECK(a.train.labels() == b.train.labels());
  CHECK(a.test.pixels() == b.test.pixels());
  CHECK(a.train.pixels() != c.train.pixels());
  CHECK(a.train.labels() != c.train.labels());
  // Train and test are different draws, not copies.
  CHECK(!std::equal(a.test.pixels().begin(), a.test.pixels().end(), a.train.pixels().begin()));
}

TEST_CASE("Synthetic classes are learnable: nearest class mean beats chance by far",
          "[data][synthetic]") {
  // The Fashion-MNIST shape, and a colour one of another size (--synthetic-shape).
  for (const ImageShape shape : {ImageShape{1, 28, 28}, ImageShape{3, 40, 32}}) {
    INFO("shape " << shape.channels << "x" << shape.height << "x" << shape.width);
    const DatasetSplits s = make_synthetic_splits({.train_size = 2000, .test_size = 500, .seed = 3, .shape = shape});
    CHECK(s.train.shape() == shape);
    const auto pixels = static_cast<size_t>(shape.numel());
    std::vector<std::vector<double>> mean(10, std::vector<double>(pixels, 0.0));
    std::vector<int64_t> count(10, 0);
    for (int64_t i = 0; i < s.train.size(); ++i) {
      const auto cls = static_cast<size_t>(s.train.label(i));
      ++count[cls];
      for (size_t p = 0; p < pixels; ++p) mean[cls][p] += s.train.image(i)[p];
    }
    for (size_t c = 0; c < 10; ++c) {
      REQUIRE(count[c] > 100);  // labels are spread over every class
      for (double& v : mean[c]) v /= static_cast<double>(count[c]);
    }
    int64_t correct = 0;
    for (int64_t i = 0; i < s.test.size(); ++i) {
      size_t best = 0;
      double best_distance = 1e300;
      for (size_t c = 0; c < 10; ++c) {
        double d = 0;
        for (size_t p = 0; p < pixels; ++p) {
          const double diff = s.test.image(i)[p] - mean[c][p];
          d += diff * diff;
        }
        if (d < best_distance) best_distance = d, best = c;
      }
      correct += best == static_cast<size_t>(s.test.label(i));
    }
    const double accuracy = static_cast<double>(correct) / static_cast<double>(s.test.size());
    INFO("nearest-class-mean accuracy " << accuracy);
    CHECK(accuracy > 0.6);  // chance is 0.1
  }
}
