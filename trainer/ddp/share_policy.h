// SharePolicy: how many images of each global batch each rank takes (--balance), decided from
// every rank's measured compute time per image. Pure arithmetic on what every rank passes in the
// same order, so every rank reaches the same shares without another collective (Note [Shares by
// integer arithmetic] in data/distributed_sampler.cpp). The policy is in share_policy.cpp:
// Note [Measuring each rank's speed], Note [When the shares change], Note [A hopeless rank].
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trainer/ddp/step_exchange.h"

namespace mtrain {

struct BalanceOptions {
  int64_t global_batch = 0;
  std::vector<int64_t> initial_shares;  // one per rank, summing to global_batch
  bool automatic = false;               // false: the shares never change (even or static)
  // A rank too slow to be worth one image may get none (Note [A hopeless rank]); false
  // with SyncBatchNorm, whose forward needs every rank's images.
  bool allow_empty_share = true;
  int64_t warmup_steps = 2;   // measured steps ignored at the start
  int64_t window_steps = 16;  // each rank's time per image is the mean over its last this many
  int64_t min_samples = 3;    // measured steps needed before the first change
  int64_t min_interval = 10;  // steps from one change to the next
  int64_t min_gain_percent = 5;  // a change must shorten the predicted step by this much, and by
                                 // twice the noise of the means (Note [When the shares change])
};

struct ShareChange {
  int64_t step = 0;  // the step whose measurements decided it
  std::vector<int64_t> before;
  std::vector<int64_t> after;
  std::vector<double> seconds_per_image;  // by rank, the window's mean
  double predicted_before = 0.0;          // seconds of compute per step at `before`
  double predicted_after = 0.0;
  std::vector<int> hopeless;  // ranks given no images (Note [A hopeless rank])
};

class SharePolicy {
 public:
  // Throws InvalidArgument for initial shares of the wrong sum or a negative share.
  explicit SharePolicy(BalanceOptions options);

  // One step's measurements, by rank (every rank passes the same values). Returns the new
  // shares when the balancer moves them; the caller applies them to later steps.
  std::optional<ShareChange> observe(int64_t step, const std::vector<RankCompute>& ranks);

  const std::vector<int64_t>& shares() const { return shares_; }
  const BalanceOptions& options() const { return options_; }
  // Mean seconds per image by rank over the window; nullopt for a rank not measured yet.
  std::vector<std::optional<double>> seconds_per_image() const;
  // Over the steps every rank measured: the slowest rank's compute summed (what the split
  // cost) and the same estimated for the even split (Note [What balancing saved]).
  double measured_seconds() const { return measured_ns_ * 1e-9; }
  double even_split_seconds() const { return even_ns_ * 1e-9; }
  int64_t measured_steps() const { return measured_steps_; }
  int64_t changes() const { return changes_; }

 private:
  std::optional<ShareChange> propose(int64_t step);
  // Whether a predicted gain from `now` to `then` (picoseconds) exceeds twice the
  // noisiest rank's relative standard error of its mean (Note [When the shares change]).
  bool beats_noise(__int128 now, __int128 then) const;
  // The window's mean per rank, in picoseconds per image; 0 for a rank without samples.
  std::vector<int64_t> picoseconds_per_image() const;

  BalanceOptions options_;
  std::vector<int64_t> even_;    // torch.chunk's split of the global batch
  std::vector<int64_t> shares_;  // in force for the steps to come
  // Per rank, the last window_steps times per image (picoseconds), oldest first.
  std::vector<std::vector<int64_t>> windows_;
  std::vector<int64_t> previous_images_;        // of the last step seen
  int64_t valid_steps_ = 0;
  int64_t last_change_step_ = -1;
  int64_t changes_ = 0;
  double measured_ns_ = 0.0;
  double even_ns_ = 0.0;
  int64_t measured_steps_ = 0;
};

// Parses --balance: "even", "auto" or "static:N0,N1,..." (integers >= 0). Throws
// InvalidArgument naming the flag and what was found.
struct BalanceSpec {
  enum class Kind { kEven, kAuto, kStatic } kind = Kind::kEven;
  std::vector<int64_t> shares;  // kStatic
};
BalanceSpec parse_balance(const std::string& text);

// "171,85".
std::string format_shares(const std::vector<int64_t>& shares);

}  // namespace mtrain
