// Reducer: DDP's bucketed gradient all-reduce, overlapped with backward.
//
// Note [Reducer buckets]
// ~~~~~~~~~~~~~~~~~~~~~~
// Parameters are packed into buckets in reverse registration order (the order their
// gradients roughly become ready in backward), a small first bucket (1 MiB) so the
// first all-reduce starts early, then buckets of up to --bucket-cap-mb (25 MiB). A
// parameter larger than the cap gets a bucket of its own. The layout depends only on
// the parameter list and the caps, and attach() all-gathers a hash of it so a rank with
// a different model or cap fails at once with the ranks named (Note [Consensus by
// hashes] in rank_consensus.h), never later inside a mismatched all-reduce.
//
// Note [Reducer launch order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The grad-ready hook marks a parameter ready; a bucket is ready when all of its
// parameters are. Inside a Residual block hooks do not fire in reverse registration
// order, so bucket k may become ready before bucket k-1. Collectives must be issued in
// the same order on every rank, so buckets are launched strictly in index order: a
// ready bucket whose predecessors have not launched waits, and launches (from the hook
// that completes its last predecessor) the moment they have. Launching copies the
// bucket's gradients into its flat buffer, scaled by the rank's weight, and starts an
// asynchronous all-reduce (sum) that runs on the process group's thread while backward
// goes on with earlier layers.
//
// Note [Reducer gradient weighting]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each rank's gradient is the mean over its own micro-batch. Pre-scaling by 1/W and
// summing gives the mean over all ranks' samples when every rank has the same count
// (PyTorch's DDP divides the same way). Pre-scaling (rather than dividing after the
// sum) keeps the values in range and costs nothing extra: the launch does it in place.
//
// With uneven per-rank counts (--global-batch-size) the reducer first all-reduces the
// counts (8 bytes) and asks the loop to scale the loss gradient by W * count_r / total
// (loss_gradient_scale()). Every rank's loss gradient is then W times the gradient of
// the global mean loss, the same scale everywhere, and the 1/W pre-scale and the sum
// give exactly the single-process gradient. Scaling the buckets by count_r / total
// instead gives the same parameter gradients of layers that only see their own rank's
// samples, but not through SyncBatchNorm: its backward sums dy over the ranks before
// any bucket exists, and a rank with 2 of 10 images would weigh its dy 2x in those sums
// (tested: resnet18 --sync-bn on 3 ranks with shares 4, 4, 2 against one rank).
//
// Note [Gradients are views into the buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The reducer re-seats every parameter's gradient as a view into its bucket
// (PyTorch's gradient_as_bucket_view=True): layers accumulate straight into the
// bucket, a launch scales it in place and all-reduces it in place, and nothing is
// copied back. That saves a second copy of every gradient (45 MiB for ResNet-18) and
// two passes over them per step. Under no_sync (--grad-accum) the views accumulate
// like any gradient. Whoever holds a Parameter must read `grad` through it rather
// than keep an old Tensor handle, which the optimizer and the layers do.
//
// A rank whose micro-batch is empty (a --global-batch-size chunk that torch.chunk
// leaves empty, e.g. G = 5 on 4 ranks, or an epoch's small last batch) runs no
// backward; the loop still calls before/after_backward, and the reducer then launches
// every bucket with weight 0 so the collectives still match.
//
// Note [Reducer statistics]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Per synchronized step: the time after_backward spent waiting for the all-reduces
// (communication not hidden behind backward), the span from the first launch to the
// moment all were done, and the fraction hidden = 1 - wait / span. For each bucket the
// launch order and how many parameters were still waiting for their gradient when it
// launched: a positive count proves the all-reduce overlapped backward (the overlap
// test checks it; an ordering fact, not a timing threshold).
//
// On a GPU (Note [Reducer on a GPU]) the buckets are awaited on the GPU stream, not on
// the host, so wait_seconds is only the host's own blocking in after_backward (the
// exchange of stop votes) and hidden_fraction is not measured:
// ReducerStepStats::waited_on_device says so, and the metrics report the fraction as
// null rather than a flattering 1. The launch order and params_pending stay exact.
//
// On every synchronized micro-batch the reducer also carries the ranks' stop votes
// (Note [Agreeing to stop] in gradient_sync.h) and their waits of the step before
// (Note [Every rank's wait]): an all-gather of two int64 per rank, issued in
// before_backward ahead of the buckets and waited for with them. The agreed vote is
// the largest. The votes, the waits and the per-rank sample counts are host values and
// travel on the control group (Note [Control-plane collectives] in training_groups.h).
//
// Note [Every rank's wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Rank 0's wait after backward mixes two costs: communication that backward did not
// hide, and time spent while a slower rank was still in its backward (the all-reduce
// of the last bucket cannot finish before the last rank launches it). The two call
// for different remedies (bigger or smaller buckets, a faster link; or finding out
// what slows that rank), and one rank cannot tell them apart. The rank that finishes
// backward last can: its peers are done, so all it waits for is communication. So
// each step's exchange also carries every rank's wait of the step before, and rank 0
// sums them (RankWaits): per rank the wait, per rank the steps in which it waited
// least (it finished backward last: the step's slowest rank), and the per-step
// minimum over the ranks, the communication no rank hid. The mean wait less that
// minimum is the time ranks spent waiting for the slowest. The figures run one step
// behind the run (the last step's waits travel with a next step that never comes),
// cost 8 bytes per rank on an exchange that happens anyway, and are not measured when
// the buckets are awaited on a GPU (there the host's wait is not the communication's).
//
// What the split does not see: waiting anywhere else. With --global-batch-size the
// blocking sample-count all-reduce in before_backward (and, without --sync-bn, the
// buffer broadcast before forward) lines the ranks up again, so an imbalance in
// forward or data loading is spent there and only backward's shows up here; so is
// SyncBatchNorm's per-layer waiting (its own metric). With --grad-compression the
// conversion of the buckets back to float32 counts as communication. And with many
// noisy ranks the per-step minimum tends low: some rank is usually lucky.
//
// Note [Reducer on a GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The buckets live on the parameters' device (attach() requires one device for all of
// them), so gradients are views into GPU memory and a launch is a GPU kernel
// (ops::scale_) followed by the all-reduce, which the process group orders after the
// work queued on the current stream. after_backward then calls
// Work::wait_on_current_stream() for each bucket: it returns at once and the optimizer
// step queued next runs after the all-reduces on the GPU, so the host is never blocked
// on communication (Note [Asynchronous collectives] in collectives/process_group.h).
// A failed all-reduce surfaces through the group (a later wait, the next operation or
// its watchdog at the deadline) rather than in this call.
//
// Note [Gradient compression]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// --grad-compression bf16|fp16 is PyTorch DDP's bf16_compress_hook / fp16_compress_hook:
// each bucket, once scaled (by 1/W or by its sample weight), is converted to the 16-bit
// type (round to nearest even) into a wire buffer of its own, the all-reduce sums the
// wire buffers in that type (Note [Half-precision reductions] in collectives/half_math.h;
// NCCL natively), and after the wait the result is converted back into the bucket, so
// every gradient the optimizer sees is float32 again. Half the bytes travel, at the
// price of a 16-bit rounding of each rank's gradient and of every partial sum. Every
// rank receives the same sum, so the replicas stay bitwise identical. float16 keeps 11
// significant bits but flushes values below 2^-24 to zero (its loss scaling, Note
// [Dynamic loss scaling], applies before the buckets are reduced); bfloat16 keeps
// float32's range and 8 significant bits.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/process_group.h"
#include "models/module.h"
#include "trainer/ddp/gradient_sync.h"

namespace mtrain {

inline constexpr size_t kFirstBucketBytes = size_t{1} << 20;
inline constexpr double kDefaultBucketCapMb = 25.0;

struct ReducerOptions {
  size_t first_bucket_bytes = kFirstBucketBytes;
  size_t bucket_cap_bytes = static_cast<size_t>(kDefaultBucketCapMb * 1024 * 1024);
  // Weight each rank's gradient by its sample count (Note [Reducer gradient weighting]).
  bool weight_by_sample_count = false;
  // The type the buckets travel in: Float32, or BFloat16/Float16 (Note [Gradient
  // compression]).
  DType compression = DType::Float32;
};

struct BucketLaunch {
  int bucket = 0;
  int params_pending = 0;  // parameters of the model still without a final gradient at launch
};

struct ReducerStepStats {
  std::vector<BucketLaunch> launches;  // in launch order
  double wait_seconds = 0.0;           // after_backward waiting for the all-reduces
  double comm_span_seconds = 0.0;      // first launch to all done
  double hidden_fraction = 0.0;        // 1 - wait / span, in [0, 1]; 0 when waited_on_device
  // The buckets were awaited on the GPU stream (Note [Reducer on a GPU]): wait_seconds
  // is host blocking only, and hidden_fraction was not measured.
  bool waited_on_device = false;
};

// Note [Every rank's wait]: sums over the synchronized steps whose waits every rank
// has reported.
struct RankWaits {
  int64_t steps = 0;
  std::vector<double> wait_seconds;    // by rank, summed over the steps
  std::vector<int64_t> slowest_steps;  // by rank: steps in which it waited least (ties: the lowest rank)
  double exposed_seconds = 0.0;        // summed per-step minimum over the ranks

  // One step's waits, one per rank; every step must name the same number of ranks.
  void add_step(const std::vector<double>& waits);
  // Mean over ranks and steps (0 before the first step).
  double mean_wait_seconds() const;
};

// One line for the log: the mean wait per step split into communication and waiting
// for the slowest rank, and which ranks were slowest how often.
std::string describe_rank_waits(const RankWaits& waits);

struct ReducerTotals {
  int64_t synced_steps = 0;
  double wait_seconds = 0.0;
  double comm_span_seconds = 0.0;
  // Over the whole run: 1 - total wait / total span (0 when nothing was reduced).
  double hidden_fraction() const;
};

class Reducer final : public GradientSynchronizer {
 public:
  // `group` reduces the gradient buckets (on the parameters' device); `control` carries
  // the host values (Note [Control-plane collectives] in training_groups.h) and
  // defaults to `group`. Both must have the same ranks.
  Reducer(std::shared_ptr<ProcessGroup> group, ReducerOptions options,
          std::shared_ptr<ProcessGroup> control = nullptr);

  // Builds the buckets and verifies the layout on every rank (a collective).
  void attach(models::Module& model) override;
  void before_backward(const MicroBatchInfo& micro_batch) override;
  float loss_gradient_scale() const override { return loss_scale_; }
  void after_backward() override;
  std::string describe() const override;
  int64_t agreed_stop_vote() const override { return agreed_stop_vote_; }

  // Bucket k holds these parameter indices (positions in model.parameters()).
  const std::vector<std::vector<int>>& bucket_parameters() const { return bucket_params_; }
  const ReducerStepStats& last_step() const { return last_step_; }
  const ReducerTotals& totals() const { return totals_; }
  // Every rank's waits (Note [Every rank's wait]); steps stays 0 on a GPU.
  const RankWaits& rank_waits() const { return rank_waits_; }

 private:
  struct Bucket {
    std::vector<int> params;
    std::vector<int64_t> offsets;  // element offset of each parameter in `flat`
    Tensor flat;
    Tensor wire;      // the 16-bit copy that travels (Note [Gradient compression]); else undefined
    int pending = 0;  // parameters not yet ready in this backward
    WorkPtr work;
  };
  using Clock = std::chrono::steady_clock;

  void on_gradient_ready(models::Parameter& param);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  // Reads the finished exchange: the agreed stop vote, every rank's previous wait.
  void take_exchange();

  std::shared_ptr<ProcessGroup> group_;
  ReducerOptions options_;
  std::shared_ptr<ProcessGroup> control_;
  Device device_ = Device::cpu();                // where the buckets live
  std::vector<std::string> names_;              // by parameter index
  std::vector<models::Parameter*> params_;      // by parameter index
  std::vector<int> bucket_of_;                  // parameter index -> bucket
  std::vector<std::vector<int>> bucket_params_;
  std::vector<Bucket> buckets_;
  std::vector<int> ready_count_;                // hook calls per parameter this backward
  int params_pending_ = 0;
  size_t next_launch_ = 0;
  bool sync_ = true;
  bool empty_micro_batch_ = false;  // no backward runs: every gradient is final as is
  float scale_ = 1.0f;
  float loss_scale_ = 1.0f;  // loss_gradient_scale() of the current micro-batch
  bool first_launch_seen_ = false;
  Clock::time_point first_launch_;
  ReducerStepStats last_step_;
  ReducerTotals totals_;
  // The per-step exchange: {stop vote, previous wait in ns} of this rank, and of all.
  Tensor exchange_mine_;  // int64 [2]
  Tensor exchange_all_;   // int64 [2 * world]
  WorkPtr exchange_work_;
  int64_t agreed_stop_vote_ = 0;
  // This rank's wait in the last synchronized step, in ns; -1 before the first and
  // when it was not measured (Note [Every rank's wait]).
  int64_t previous_wait_ns_ = -1;
  RankWaits rank_waits_;
};

}  // namespace mtrain
