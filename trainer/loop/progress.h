// Progress that never goes quiet (rank 0): on a terminal, a bar per epoch that redraws
// in place (steps, img/s, loss, ETA; evaluation too); in a log file or under a
// scheduler, a progress line at least every --progress-every seconds between the
// --log-every lines. Other ranks show nothing (Note [Progress that never goes quiet]).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace mtrain {

class Progress {
 public:
  enum class Mode {
    kBar,    // standard output is a terminal: one line redrawn in place
    kLines,  // a file or a pipe: a log line when the last one is older than the interval
    kOff,    // ranks other than 0
  };
  // kBar for rank 0 on a terminal (TERM not "dumb"), kLines for rank 0 elsewhere, kOff
  // for the other ranks and when info lines are not shown (--log-level warn).
  static Mode mode_for(int rank, bool info_shown);
  // For kBar: makes the default logger write around the bar. Call before configuring
  // the logger's level and pattern, which it keeps from then on.
  static void prepare_logging(Mode mode);

  // `interval_s`: the longest quiet stretch in kLines mode.
  Progress(Mode mode, double interval_s);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  Mode mode() const { return mode_; }

  // An epoch starts, `done` of its steps already behind it (a resume mid-epoch): the
  // time left is estimated from the steps this run takes.
  void begin_epoch(int64_t done);
  // A training step ended: `step` of `steps` in the epoch, `loss` the mean since the
  // last log line, `img_per_s` the recent rate.
  void step(int64_t epoch, int64_t step, int64_t steps, int64_t total_steps, double loss, double img_per_s);
  // An evaluation batch ended.
  void eval_batch(int64_t epoch, int64_t batch, int64_t batches);
  // A --log-every line was just printed: the quiet stretch starts again.
  void logged();
  // The epoch ended: the bar is removed (its line is printed next).
  void end_epoch();

  // "1:05" / "1:02:03"; exposed for tests.
  static std::string format_duration(double seconds);
  // The bar's text for `done` of `total` in `width` cells; exposed for tests.
  static std::string bar(int64_t done, int64_t total, int width);

 private:
  using Clock = std::chrono::steady_clock;
  void show(const std::string& text, bool force);
  bool quiet_for_interval() const;

  Mode mode_;
  std::chrono::duration<double> interval_;
  Clock::time_point last_output_;
  Clock::time_point last_draw_;
  Clock::time_point epoch_start_;
  int64_t first_step_ = 0;
};

}  // namespace mtrain
