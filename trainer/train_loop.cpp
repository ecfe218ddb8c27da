#include "trainer/train_loop.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>

#include "core/error.h"
#include "models/loss.h"

namespace mtrain {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double rate(double amount, double seconds) { return seconds > 0 ? amount / seconds : 0.0; }

// Loss and throughput since the previous progress line.
struct ProgressWindow {
  double loss_sum = 0.0;  // sum of per-step mean losses
  int64_t steps = 0;
  int64_t images = 0;
  double seconds = 0.0;

  void reset() { *this = ProgressWindow{}; }
};

}  // namespace

std::string format_epoch_line(const EpochSummary& s, const std::vector<std::string>& devices) {
  std::string line = fmt::format("epoch {}, loss {:.3f}, train acc {:.3f}", s.epoch, s.train_loss, s.train_acc);
  if (s.test) line += fmt::format(", test acc {:.3f}", s.test->accuracy());
  line += fmt::format(", {:.1f} sec/epoch, {:.0f} img/s on [{}]", s.train_seconds, s.images_per_second,
                      fmt::join(devices, ", "));
  return line;
}

TrainLoop::TrainLoop(models::Module& model, models::Sgd& optimizer, GradientSynchronizer& sync,
                     data::DataLoader& train_loader, data::DataLoader* test_loader,
                     MetricsWriter& metrics, TrainLoopConfig config)
    : model_(model),
      optimizer_(optimizer),
      sync_(sync),
      train_loader_(train_loader),
      test_loader_(test_loader),
      metrics_(metrics),
      config_(std::move(config)) {}

bool TrainLoop::step_limit_reached() const {
  return config_.max_steps && total_steps_ >= *config_.max_steps;
}

std::vector<EpochSummary> TrainLoop::run() {
  std::vector<EpochSummary> summaries;
  models::CrossEntropyLoss loss_fn;
  const int64_t batches_per_epoch = train_loader_.num_batches();

  // Time is summed per step (waiting for the batch included, evaluation and logging
  // excluded), so a progress window may span an epoch boundary without counting the
  // evaluation in between as training time.
  ProgressWindow window;
  for (int64_t epoch = 1; epoch <= config_.epochs && !step_limit_reached(); ++epoch) {
    model_.train();
    // The sampler's epoch is 0-based (seed + epoch, as PyTorch); the printed one 1-based.
    train_loader_.start_epoch(epoch - 1);
    EpochSummary s;
    s.epoch = epoch;
    double loss_sum = 0.0;  // per-image losses, summed
    int64_t correct = 0;

    while (!step_limit_reached()) {
      const auto step_start = Clock::now();
      auto batch = train_loader_.next();
      if (!batch) break;
      optimizer_.zero_grad();
      const Tensor logits = model_.forward(batch->images);
      const models::LossResult r = loss_fn.forward(logits, batch->labels);
      if (!std::isfinite(r.loss)) {
        throw InvalidArgument(fmt::format(
            "training diverged: the loss is {} at epoch {} step {} (try a smaller --lr than {})", r.loss,
            epoch, total_steps_ + 1, optimizer_.lr()));
      }
      sync_.before_backward();
      model_.backward(loss_fn.backward());
      sync_.after_backward();
      optimizer_.step();
      const double step_seconds = seconds_since(step_start);

      ++total_steps_;
      ++s.steps;
      s.images += r.count;
      s.train_seconds += step_seconds;
      loss_sum += r.loss * static_cast<double>(r.count);
      correct += r.correct;
      window.loss_sum += r.loss;
      ++window.steps;
      window.images += r.count;
      window.seconds += step_seconds;

      if (total_steps_ % config_.log_every == 0) {
        const double mean_loss = window.loss_sum / static_cast<double>(window.steps);
        const double img_per_s = rate(static_cast<double>(window.images), window.seconds);
        spdlog::info("epoch {} step {}/{} (total {}): loss {:.4f}, {:.0f} img/s", epoch, s.steps,
                     batches_per_epoch, total_steps_, mean_loss, img_per_s);
        metrics_.write({{"event", "step"},
                        {"epoch", epoch},
                        {"step", total_steps_},
                        {"loss", json_number(mean_loss)},
                        {"lr", optimizer_.lr()},
                        {"img_per_s", json_number(img_per_s)},
                        {"images", window.images},
                        {"sec", window.seconds}});
        window.reset();
      }
    }
    s.total_steps = total_steps_;
    if (s.images == 0) break;  // max_steps hit exactly at the previous epoch's end
    s.train_loss = loss_sum / static_cast<double>(s.images);
    s.train_acc = static_cast<double>(correct) / static_cast<double>(s.images);
    s.images_per_second = rate(static_cast<double>(s.images), s.train_seconds);

    if (test_loader_ != nullptr) {
      const auto eval_start = Clock::now();
      s.test = evaluate(model_, *test_loader_);
      s.eval_seconds = seconds_since(eval_start);
    }
    spdlog::info("{}", format_epoch_line(s, config_.devices));
    nlohmann::json event = {{"event", "epoch"},
                            {"epoch", epoch},
                            {"step", total_steps_},
                            {"train_loss", json_number(s.train_loss)},
                            {"train_acc", s.train_acc},
                            {"test_loss", s.test ? json_number(s.test->mean_loss()) : nullptr},
                            {"test_acc", s.test ? nlohmann::json(s.test->accuracy()) : nullptr},
                            {"sec", s.train_seconds},
                            {"eval_sec", s.eval_seconds},
                            {"img_per_s", json_number(s.images_per_second)},
                            {"devices", config_.devices}};
    metrics_.write(event);
    summaries.push_back(s);
  }
  return summaries;
}

}  // namespace mtrain
