// Cross-entropy, accuracy counting and the SGD step.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "tensor/ops.h"
#include "tests/tensor/reference.h"

using namespace mtrain;
using mtrain::testing::random_tensor;
using mtrain::testing::require_close;

TEST_CASE("cross_entropy matches a hand-computed case", "[loss]") {
  // Row 0: logits 1,2,3, label 2: loss = log(e + e^2 + e^3) - 3 = log(1 + e^-1 + e^-2);
  //        softmax = (0.0900306, 0.2447285, 0.6652410).
  // Row 1: equal logits, label 0: loss = log 3, softmax = 1/3 each.
  const Tensor logits = Tensor::from_vector<float>({1, 2, 3, 1, 1, 1}, {2, 3});
  const Tensor labels = Tensor::from_vector<int64_t>({2, 0}, {2});
  Tensor d = Tensor::empty({2, 3});
  const double loss = ops::cross_entropy(logits, labels, d, 0.5f);
  CHECK(loss == Approx(0.4076059644 + 1.0986122887).epsilon(1e-6));
  require_close(d, {0.0450153, 0.1223643, -0.1673795, -0.3333333, 0.1666667, 0.1666667}, 1e-6, 1e-5);
  // Without dlogits only the loss is computed.
  Tensor none;
  CHECK(ops::cross_entropy(logits, labels, none, 1.0f) == Approx(loss));
}

TEST_CASE("cross_entropy is stable for huge logits and its gradient is right", "[loss]") {
  const Tensor logits = Tensor::from_vector<float>({1000, 0, -1000, 0}, {2, 2});
  const Tensor labels = Tensor::from_vector<int64_t>({1, 0}, {2});
  Tensor d = Tensor::empty({2, 2});
  const double loss = ops::cross_entropy(logits, labels, d, 1.0f);
  CHECK(loss == Approx(2000.0));
  require_close(d, {1, -1, -1, 1}, 1e-6, 0);

  Tensor z = random_tensor({5, 7}, 61, -3.0f, 3.0f);
  const Tensor y = Tensor::from_vector<int64_t>({0, 6, 3, 3, 1}, {5});
  Tensor none;
  Tensor grad = Tensor::empty(z.shape());
  ops::cross_entropy(z, y, grad, 0.2f);
  auto mean_loss = [&] { return ops::cross_entropy(z, y, none, 1.0f) / 5.0; };
  require_close(grad, testing::finite_difference(z, mean_loss, 1e-2f), 1e-4, 1e-3);
}

TEST_CASE("cross_entropy and count_correct reject labels outside [0, K)", "[loss]") {
  const Tensor logits = random_tensor({2, 10}, 62);
  Tensor d = Tensor::empty({2, 10});
  const Tensor high = Tensor::from_vector<int64_t>({3, 10}, {2});
  const Tensor negative = Tensor::from_vector<int64_t>({-1, 0}, {2});
  CHECK_THROWS_WITH(ops::cross_entropy(logits, high, d, 1.0f),
                    Catch::Contains("label 10") && Catch::Contains("[0, 10)"));
  CHECK_THROWS_AS(ops::cross_entropy(logits, negative, d, 1.0f), InvalidArgument);
  CHECK_THROWS_AS(ops::count_correct(logits, high), InvalidArgument);
  const Tensor int32_labels = Tensor::from_vector<int32_t>({1, 2}, {2});
  CHECK_THROWS_AS(ops::cross_entropy(logits, int32_labels, d, 1.0f), InternalError);
}

TEST_CASE("count_correct counts rows whose first maximum is the label", "[loss]") {
  const Tensor logits = Tensor::from_vector<float>({0, 5, 1, 2, 2, 0, 9, 1, 9, -1, -2, -3}, {4, 3});
  // argmax per row: 1, 0 (tie: first), 0 (tie: first), 0.
  CHECK(ops::count_correct(logits, Tensor::from_vector<int64_t>({1, 0, 2, 0}, {4})) == 3);
  CHECK(ops::count_correct(logits, Tensor::from_vector<int64_t>({0, 1, 0, 2}, {4})) == 1);
}

TEST_CASE("loss_stats holds cross_entropy's sum, count_correct's count and the first bad row", "[loss]") {
  const Tensor logits = random_tensor({6, 4}, 63, -3.0f, 3.0f);
  const Tensor labels = Tensor::from_vector<int64_t>({0, 3, 2, 2, 1, 0}, {6});
  Tensor d_expected = Tensor::empty({6, 4}), d = Tensor::empty({6, 4});
  const double sum = ops::cross_entropy(logits, labels, d_expected, 0.25f);
  Tensor stats = Tensor::empty({ops::kLossStats}, DType::Int64);
  ops::loss_stats(logits, labels, d, 0.25f, stats);
  const std::vector<int64_t> words = stats.to_vector<int64_t>();
  double got = 0.0;
  std::memcpy(&got, &words[0], sizeof(got));
  CHECK(got == sum);
  CHECK(words[1] == ops::count_correct(logits, labels));
  CHECK(words[2] == -1);
  CHECK(d.to_vector<float>() == d_expected.to_vector<float>());

  // A bad label is left for the reader: no throw, its row in the last word.
  ops::loss_stats(logits, Tensor::from_vector<int64_t>({0, 3, 2, 4, -1, 0}, {6}), d, 0.25f, stats);
  CHECK(stats.to_vector<int64_t>()[2] == 3);
  Tensor wrong_shape = Tensor::empty({2}, DType::Int64);
  CHECK_THROWS_AS(ops::loss_stats(logits, labels, d, 0.25f, wrong_shape), InternalError);
  // The gradient's shape is checked whatever the labels hold.
  Tensor wrong_d = Tensor::empty({6, 3});
  const Tensor bad_labels = Tensor::from_vector<int64_t>({0, 9, 0, 0, 0, 0}, {6});
  CHECK_THROWS_AS(ops::loss_stats(logits, bad_labels, wrong_d, 0.25f, stats), InternalError);
}

namespace {

// torch.optim.SGD's single-tensor update, transcribed in double.
struct TorchSgd {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  std::vector<double> buf;
  bool has_buf = false;

  void step(std::vector<double>& param, const std::vector<double>& grad) {
    std::vector<double> d_p = grad;
    for (size_t i = 0; i < d_p.size(); ++i) {
      if (weight_decay != 0) d_p[i] += weight_decay * param[i];
    }
    if (momentum != 0) {
      if (!has_buf) {
        buf = d_p;  // torch.clone(d_p)
        has_buf = true;
      } else {
        for (size_t i = 0; i < d_p.size(); ++i) buf[i] = buf[i] * momentum + (1 - dampening) * d_p[i];
      }
      for (size_t i = 0; i < d_p.size(); ++i) d_p[i] = nesterov ? d_p[i] + momentum * buf[i] : buf[i];
    }
    for (size_t i = 0; i < d_p.size(); ++i) param[i] -= lr * d_p[i];
  }
};

}  // namespace

TEST_CASE("sgd_step follows a hand-computed momentum case", "[sgd]") {
  // p = 1, g = 0.5, lr 0.1, momentum 0.9, dampening 0.1, weight decay 0.01:
  // step 1: d = 0.51, buf = 0.51 (no dampening on the first step), p = 0.949;
  // step 2: d = 0.5 + 0.00949, buf = 0.9 * 0.51 + 0.9 * 0.50949 = 0.917541, p = 0.8572459.
  Tensor p = Tensor::full({1}, 1.0f), g = Tensor::full({1}, 0.5f);
  Tensor buf = Tensor::full({1}, NAN);  // garbage must not leak into the first step
  ops::sgd_step(p, g, buf, 0.1f, 0.9f, 0.1f, 0.01f, false, true);
  CHECK(p.data<float>()[0] == Approx(0.949));
  CHECK(buf.data<float>()[0] == Approx(0.51));
  ops::sgd_step(p, g, buf, 0.1f, 0.9f, 0.1f, 0.01f, false, false);
  CHECK(buf.data<float>()[0] == Approx(0.917541));
  CHECK(p.data<float>()[0] == Approx(0.8572459));
}

TEST_CASE("sgd_step matches torch.optim.SGD over several steps", "[sgd]") {
  struct Config {
    float lr, momentum, dampening, weight_decay;
    bool nesterov;
  };
  const Config c = GENERATE(Config{0.1f, 0.0f, 0.0f, 0.0f, false},   // plain SGD
                            Config{0.05f, 0.0f, 0.0f, 5e-4f, false},  // weight decay only
                            Config{0.1f, 0.9f, 0.0f, 5e-4f, false},   // momentum
                            Config{0.1f, 0.9f, 0.3f, 0.0f, false},    // dampening
                            Config{0.1f, 0.9f, 0.0f, 1e-3f, true});   // nesterov
  const int64_t n = GENERATE(3, 70001);  // serial and parallel paths
  Tensor param = random_tensor({n}, 71);
  Tensor buf = Tensor::empty({n});
  TorchSgd ref{c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov, {}};
  std::vector<double> ref_param = testing::to_double(param);
  for (int step = 0; step < 4; ++step) {
    const Tensor grad = random_tensor({n}, 80 + step);
    Tensor no_buf;
    ops::sgd_step(param, grad, c.momentum != 0 ? buf : no_buf, c.lr, c.momentum, c.dampening,
                  c.weight_decay, c.nesterov, step == 0);
    ref.step(ref_param, testing::to_double(grad));
  }
  require_close(param, ref_param, 1e-6, 1e-5);
  if (c.momentum != 0) require_close(buf, ref.buf, 1e-6, 1e-5);
}

namespace {

// The bytes of a float tensor, for bit-for-bit comparisons (== on floats would let
// -0 equal 0 and fail on NaN).
std::vector<uint32_t> bits(const Tensor& t) {
  std::vector<uint32_t> out(static_cast<size_t>(t.numel()));
  std::memcpy(out.data(), t.data<float>(), t.nbytes());
  return out;
}

}  // namespace

TEST_CASE("sgd_step_all equals sgd_step on each parameter, bit for bit", "[sgd]") {
  struct Config {
    float lr, momentum, dampening, weight_decay;
    bool nesterov;
  };
  const Config c = GENERATE(Config{0.1f, 0.0f, 0.0f, 0.0f, false},   // plain SGD
                            Config{0.05f, 0.0f, 0.0f, 5e-4f, false},  // weight decay only
                            Config{0.1f, 0.9f, 0.0f, 5e-4f, false},   // momentum
                            Config{0.1f, 0.9f, 0.3f, 1e-4f, false},   // dampening
                            Config{0.1f, 0.9f, 0.0f, 1e-3f, true});   // nesterov
  // Odd sizes, an empty parameter and one large enough for the threaded loop.
  const std::vector<Shape> shapes = {{7}, {3, 5}, {0}, {70001}, {1}, {16, 3, 3, 3}};
  const bool use_momentum = c.momentum != 0.0f;
  std::vector<Tensor> fused_params, fused_bufs, single_params, single_bufs, grads;
  for (size_t i = 0; i < shapes.size(); ++i) {
    fused_params.push_back(random_tensor(shapes[i], 100 + static_cast<uint32_t>(i)));
    single_params.push_back(fused_params.back().clone());
    // Garbage in the buffers must not matter on the first step (NaN would show).
    fused_bufs.push_back(use_momentum ? Tensor::full(shapes[i], NAN) : Tensor());
    single_bufs.push_back(use_momentum ? fused_bufs.back().clone() : Tensor());
    grads.push_back(Tensor::empty(shapes[i]));
  }
  std::vector<ops::SgdParamRef> refs;
  for (size_t i = 0; i < shapes.size(); ++i) {
    // Without momentum the buffer may be absent altogether.
    refs.push_back({&fused_params[i], &grads[i], use_momentum ? &fused_bufs[i] : nullptr});
  }
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      grads[i] = random_tensor(shapes[i], 200 + static_cast<uint32_t>(10 * step + i));
      ops::sgd_step(single_params[i], grads[i], single_bufs[i], c.lr, c.momentum, c.dampening,
                    c.weight_decay, c.nesterov, step == 0);
    }
    ops::sgd_step_all(refs, c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov, step == 0);
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    CAPTURE(i);
    CHECK(bits(fused_params[i]) == bits(single_params[i]));
    if (use_momentum) CHECK(bits(fused_bufs[i]) == bits(single_bufs[i]));
  }
  // The update really happened (a no-op would also match nothing-changed references).
  CHECK(bits(fused_params[0]) != bits(random_tensor(shapes[0], 100)));
}

TEST_CASE("sgd_step_all on an empty list does nothing, and bad entries are errors", "[sgd]") {
  ops::sgd_step_all({}, 0.1f, 0.9f, 0.0f, 0.0f, false, true);

  Tensor p = random_tensor({4}, 90), g = random_tensor({4}, 91);
  Tensor undefined_buf;
  const std::vector<ops::SgdParamRef> no_buffer{{&p, &g, &undefined_buf}};
  CHECK_THROWS_AS(ops::sgd_step_all(no_buffer, 0.1f, 0.9f, 0.0f, 0.0f, false, true), InternalError);
  const std::vector<ops::SgdParamRef> no_grad{{&p, nullptr, nullptr}};
  CHECK_THROWS_WITH(ops::sgd_step_all(no_grad, 0.1f, 0.0f, 0.0f, 0.0f, false, true),
                    Catch::Contains("parameter 0 has no grad"));
  // A missing first parameter has no device; the CPU entry reports it.
  const std::vector<ops::SgdParamRef> no_param{{nullptr, &g, nullptr}};
  CHECK_THROWS_WITH(ops::sgd_step_all(no_param, 0.1f, 0.0f, 0.0f, 0.0f, false, true),
                    Catch::Contains("parameter 0 has no param tensor"));
  Tensor buf = Tensor::empty({4});
  const std::vector<ops::SgdParamRef> nesterov_with_dampening{{&p, &g, &buf}};
  CHECK_THROWS_AS(ops::sgd_step_all(nesterov_with_dampening, 0.1f, 0.9f, 0.5f, 0.0f, true, true),
                  InternalError);
}
