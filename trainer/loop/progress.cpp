#include "trainer/loop/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include <fmt/format.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

namespace mtrain {

namespace {

// Note [Progress that never goes quiet]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A ResNet-18 step on two CPU cores takes seconds, so --log-every 20 can leave a run
// silent for minutes, and evaluation printed nothing until its end. Rank 0 therefore
// reports every step, in one of two ways:
//  - on a terminal, one line redrawn in place ("\r" and erase-to-end-of-line, ECMA-48's
//    EL, which every terminal emulator and tmux understand), at most ten times a second.
//    Log lines must not land in the middle of it, so while a bar is shown the default
//    logger writes through BarSink: it erases the bar, writes the line, and draws the
//    bar again, under one mutex with the bar's own redraws;
//  - anywhere else (a log file, a pipe, SLURM's output), a progress line whenever
//    --progress-every seconds passed since the last line of its kind or of --log-every,
//    so a log never goes quiet for longer, and a redrawn bar never fills it with "\r".
// No packaged C++ library draws such bars (Debian 12 has none), and this one is small.

// The default logger's sink while a bar may be shown.
class BarSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  void set_bar(const std::string& bar) {
    std::lock_guard<std::mutex> lock(mutex_);
    bar_ = bar;
    write_stdout("\r\x1b[K" + bar_);
  }
  void clear_bar() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bar_.empty()) return;
    bar_.clear();
    write_stdout("\r\x1b[K");
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::string text = bar_.empty() ? std::string() : std::string("\r\x1b[K");
    text.append(formatted.data(), formatted.size());
    text += bar_;
    write_stdout(text);
  }
  void flush_() override { std::fflush(stdout); }

 private:
  static void write_stdout(const std::string& text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  }
  std::string bar_;
};

std::shared_ptr<BarSink>& bar_sink() {
  static std::shared_ptr<BarSink> sink;
  return sink;
}

// Routes the default logger through a BarSink.
void install_bar_sink() {
  if (bar_sink()) return;
  auto sink = std::make_shared<BarSink>();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(spdlog::default_logger()->name(), sink));
  bar_sink() = sink;
}

}  // namespace

Progress::Mode Progress::mode_for(int rank, bool info_shown) {
  if (rank != 0 || !info_shown) return Mode::kOff;
  const char* term = std::getenv("TERM");
  const bool terminal = ::isatty(STDOUT_FILENO) == 1 && term != nullptr && std::strcmp(term, "dumb") != 0;
  return terminal ? Mode::kBar : Mode::kLines;
}

void Progress::prepare_logging(Mode mode) {
  if (mode == Mode::kBar) install_bar_sink();
}

Progress::Progress(Mode mode, double interval_s)
    : mode_(mode), interval_(interval_s), last_output_(Clock::now()), last_draw_(Clock::time_point{}) {
  // Without the sink (prepare_logging not called) a bar would tangle with the log.
  if (mode_ == Mode::kBar && !bar_sink()) mode_ = Mode::kLines;
}

Progress::~Progress() {
  if (mode_ == Mode::kBar && bar_sink()) bar_sink()->clear_bar();
}

std::string Progress::format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, std::round(seconds)));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

std::string Progress::bar(int64_t done, int64_t total, int width) {
  const int64_t filled = total > 0 ? std::clamp<int64_t>(done * width / total, 0, width) : 0;
  return fmt::format("[{}{}]", std::string(static_cast<size_t>(filled), '#'),
                     std::string(static_cast<size_t>(width - filled), '.'));
}

bool Progress::quiet_for_interval() const { return Clock::now() - last_output_ >= interval_; }

void Progress::show(const std::string& text, bool force) {
  if (mode_ == Mode::kBar) {
    const auto now = Clock::now();
    if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    bar_sink()->set_bar(text);
  } else if (mode_ == Mode::kLines && quiet_for_interval()) {
    spdlog::info("{}", text);
    last_output_ = Clock::now();
  }
}

void Progress::step(int64_t epoch, int64_t step, int64_t steps, int64_t total_steps, double loss, double img_per_s) {
  if (mode_ == Mode::kOff) return;
  const double elapsed = std::chrono::duration<double>(Clock::now() - epoch_start_).count();
  const int64_t taken = step - first_step_;
  const std::string eta = taken > 0 ? format_duration(elapsed / static_cast<double>(taken) *
                                                      static_cast<double>(steps - step))
                                    : std::string("?");
  if (mode_ == Mode::kBar) {
    show(fmt::format("epoch {} {} {}/{} loss {:.4f} {:.0f} img/s ETA {}", epoch, bar(step, steps, 20), step, steps,
                     loss, img_per_s, eta),
         step == steps);
  } else {
    show(fmt::format("epoch {} step {}/{} (total {}): loss {:.4f}, {:.0f} img/s, {} left in the epoch", epoch, step,
                     steps, total_steps, loss, img_per_s, eta),
         false);
  }
}

void Progress::eval_batch(int64_t epoch, int64_t batch, int64_t batches) {
  if (mode_ == Mode::kBar) {
    show(fmt::format("epoch {} evaluating {} {}/{} batches", epoch, bar(batch, batches, 20), batch, batches),
         batch == batches);
  } else if (mode_ == Mode::kLines) {
    show(fmt::format("epoch {}: evaluating, batch {}/{}", epoch, batch, batches), false);
  }
}

void Progress::logged() { last_output_ = Clock::now(); }

void Progress::begin_epoch(int64_t done) {
  epoch_start_ = Clock::now();
  first_step_ = done;
}

void Progress::end_epoch() {
  if (mode_ == Mode::kBar) bar_sink()->clear_bar();
}

}  // namespace mtrain
