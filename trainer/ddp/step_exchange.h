// StepExchange: what the ranks tell each other once per optimizer step besides gradients. With
// each step's synchronized micro-batch every rank sends one record (its stop vote, its wait and
// compute of the previous step, its micro-batch's sample count) and receives every rank's, in
// one all-gather on the control group. From the records every rank derives the same agreed stop
// vote (Note [Agreeing to stop]) and the same per-rank compute times (--balance), rank 0 the
// split of the waits (Note [Every rank's wait]), and each checks that the samples add up (Note
// [Ranks that split differently]).
//
// Per synchronized micro-batch the loop calls, on every rank in this order:
//     sync.before_backward -> [issue() unless issued_after_backward()] -> backward
//       -> [issue() if issued_after_backward()] -> sync.after_backward -> finish()
// (Note [The exchange's place in the step] in step_exchange.cpp). Micro-batches that are not
// synchronized exchange nothing. All calls come from the training thread. A world of one (no
// control group) sends nothing: finish() reads this rank's own record.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/process_group.h"
#include "tensor/tensor.h"
#include "trainer/ddp/gradient_sync.h"

namespace mtrain {

// One rank's forward and backward of one step, timed by that rank (trainer/loop/compute_timer.h).
struct RankCompute {
  int64_t nanoseconds = -1;  // -1: not measured
  int64_t images = 0;
};

// What this rank tells the others with a synchronized micro-batch, once its loss has been read.
struct StepReport {
  // This rank's stop vote (Note [Agreeing to stop]); 0 means carry on.
  int64_t stop_vote = 0;
  // This rank's compute of its previous synchronized step (--balance, Note [Measuring each
  // rank's speed] in share_policy.cpp).
  RankCompute previous_compute{};
};

// Sums over the synchronized steps whose waits every rank has reported (Note [Every rank's
// wait]).
struct RankWaits {
  int64_t steps = 0;
  std::vector<double> wait_seconds;    // by rank, summed over the steps
  std::vector<int64_t> slowest_steps;  // by rank: steps in which it waited least (ties: the lowest rank)
  double exposed_seconds = 0.0;        // summed per-step minimum over the ranks

  // One step's waits, one per rank; every step must name the same number of ranks (else
  // InternalError).
  void add_step(const std::vector<double>& waits);
  // Mean over ranks and steps (0 before the first step).
  double mean_wait_seconds() const;
};

// One line for the log: the mean wait per step split into communication and waiting
// for the slowest rank, and which ranks were slowest how often.
std::string describe_rank_waits(const RankWaits& waits);

class StepExchange {
 public:
  // `control` carries the exchange (null: a world of one, nothing is sent); `compute` is the
  // device the step runs on, which decides where the exchange goes (issued_after_backward()).
  StepExchange(std::shared_ptr<ProcessGroup> control, Device compute);

  // Where every rank issues the exchange (Note [The exchange's place in the step]): after the
  // backward is queued on a GPU, before the backward on the CPU.
  bool issued_after_backward() const { return compute_.is_cuda(); }

  // Sends this rank's record for the synchronized micro-batch `micro_batch` without waiting.
  // `previous_wait_ns` is this rank's wait after the previous step's backward
  // (GradientSynchronizer::last_wait_ns; -1: not measured). InternalError when the previous
  // exchange was not finished.
  void issue(const StepReport& report, const MicroBatchInfo& micro_batch, int64_t previous_wait_ns);
  // Waits for the exchange (the control group's timeout) and reads every rank's record. Throws
  // InternalError when nothing was issued, or when the ranks' sample counts do not add up to
  // the micro-batch's world_samples (Note [Ranks that split differently]); the group's
  // CommError/TimeoutError pass through.
  void finish();

  // After finish(): the largest stop vote any rank sent (Note [Agreeing to stop]); 0 before
  // the first.
  int64_t agreed_stop_vote() const { return agreed_stop_vote_; }
  // After finish(): every rank's previous_compute, by rank (the same on every rank); empty
  // before the first.
  const std::vector<RankCompute>& ranks_compute() const { return ranks_compute_; }
  // Every rank's waits (Note [Every rank's wait]); steps stays 0 where waits are not measured
  // (a GPU, a world of one).
  const RankWaits& rank_waits() const { return rank_waits_; }

 private:
  // stop vote, previous wait (ns), previous compute (ns, images), this micro-batch's samples
  static constexpr int64_t kFields = 5;

  void read(const int64_t* records, size_t world);

  std::shared_ptr<ProcessGroup> control_;
  Device compute_;
  Tensor mine_;  // int64 [kFields]
  Tensor all_;   // int64 [kFields * world]
  WorkPtr work_;
  bool issued_ = false;
  std::optional<int64_t> world_samples_;  // the issued micro-batch's planned total
  int64_t agreed_stop_vote_ = 0;
  std::vector<RankCompute> ranks_compute_;
  RankWaits rank_waits_;
};

}  // namespace mtrain
