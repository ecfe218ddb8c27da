// Reducer: DDP's gradient synchronizer (GradientSynchronizer, gradient_sync.h). attach() packs the
// gradients into buckets; during backward each bucket is all-reduced asynchronously once its gradients
// are final, and on return from after_backward() every gradient holds the same value on every rank: the
// mean over all ranks' samples (sample-weighted with --global-batch-size). Every parameter's `grad` is
// then a view into a bucket: read it through the Parameter, never through an older Tensor handle.
//
// Every member is called by the training thread, in the same order on every rank (they issue
// collectives on the group); the grad-ready hook runs on that thread during backward. Errors of the
// all-reduces surface as CommError/TimeoutError from after_backward() (on a GPU: from a later
// operation of the group). The why is in reducer.cpp's Notes, cited below.
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

// Bucket sizes (Note [Reducer buckets]): a small first bucket, then buckets up to the cap.
inline constexpr size_t kFirstBucketBytes = size_t{1} << 20;
inline constexpr double kDefaultBucketCapMb = 25.0;

struct ReducerOptions {
  // The same on every rank: attach() checks the resulting layout.
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

// One synchronized step (Note [Reducer statistics]); reset by before_backward().
struct ReducerStepStats {
  std::vector<BucketLaunch> launches;  // in launch order
  double wait_seconds = 0.0;           // after_backward waiting for the all-reduces
  double comm_span_seconds = 0.0;      // first launch to all done
  double hidden_fraction = 0.0;        // 1 - wait / span, in [0, 1]; 0 when waited_on_device
  // The buckets were awaited on the GPU stream (Note [Reducer on a GPU]): wait_seconds
  // is host blocking only, and hidden_fraction was not measured.
  bool waited_on_device = false;
};

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
  // attach()'s check of the layout (Note [Control-plane collectives] in training_groups.cpp)
  // and defaults to `group`. Both must have the same ranks (else InternalError); a zero bucket
  // cap throws InvalidArgument.
  Reducer(std::shared_ptr<ProcessGroup> group, ReducerOptions options,
          std::shared_ptr<ProcessGroup> control = nullptr);

  // Builds the buckets (Note [Reducer buckets]), re-seats every gradient as a view into its
  // bucket (Note [Gradients are views into the buckets]) and installs the grad-ready hook. A
  // collective on `control`: throws InvalidArgument naming the ranks whose parameters or layout
  // differ from rank 0's, or when the parameters are not all float32 on one device.
  void attach(models::Module& model) override;
  // Fills each bucket with zeros: every gradient is a view into one (InternalError before attach).
  void zero_gradients() override;
  // Prepares the buckets for a backward. With weight_by_sample_count, a synchronized
  // micro-batch must name its world_samples (InternalError otherwise; InvalidArgument when it
  // is 0), and the loss gradient scale follows from it (Note [Reducer gradient weighting]).
  void before_backward(const MicroBatchInfo& micro_batch) override;
  float loss_gradient_scale() const override { return loss_scale_; }
  // Marks every gradient ready, which launches every bucket of a synchronized micro-batch
  // (zeros, with weight 0 under weight_by_sample_count).
  void skip_backward() override;
  // Waits for every bucket (on a GPU: on the current stream, Note [Reducer on a GPU]); on
  // return every gradient is final (Note [Reducer launch order]). Throws InternalError when a
  // parameter reported its gradient other than once, and the all-reduces' errors.
  void after_backward() override;
  // A group of one whose buckets travel in float32 unweighted: its launches queue
  // nothing (Note [A group of one reduces nothing]).
  bool capturable() const override;
  void backward_replayed() override;
  std::string describe() const override;
  int64_t last_wait_ns() const override { return last_wait_ns_; }

  // Bucket k holds these parameter indices (positions in model.parameters()).
  const std::vector<std::vector<int>>& bucket_parameters() const { return bucket_params_; }
  const ReducerStepStats& last_step() const { return last_step_; }
  const ReducerTotals& totals() const { return totals_; }

 private:
  struct Bucket {
    std::vector<int> params;
    std::vector<int64_t> offsets;  // element offset of each parameter in `flat`
    Tensor flat;
    Tensor wire;      // the 16-bit copy that travels (Note [Gradient compression]); else undefined
    int pending = 0;  // parameters not yet ready in this backward
    WorkPtr work;     // null where nothing travels (Note [A group of one reduces nothing])
    std::chrono::steady_clock::time_point launched_at;  // this step's launch (--trace)
  };
  using Clock = std::chrono::steady_clock;

  void on_gradient_ready(models::Parameter& param);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  bool alone() const;  // Note [A group of one reduces nothing]
  // Records each bucket's all-reduce, launch to completion, on its --trace row.
  void trace_buckets(Clock::time_point all_done) const;

  std::shared_ptr<ProcessGroup> group_;
  ReducerOptions options_;
  std::shared_ptr<ProcessGroup> control_;
  Device device_ = Device::cpu();                // where the buckets live
  std::vector<std::string> names_;              // by parameter index
  std::vector<models::Parameter*> params_;      // by parameter index
  std::vector<int> bucket_of_;                  // parameter index -> bucket
  std::vector<std::vector<int>> bucket_params_;
  std::vector<Bucket> buckets_;
  bool attached_ = false;
  std::vector<int> ready_count_;                // hook calls per parameter this backward
  int params_pending_ = 0;
  size_t next_launch_ = 0;
  bool sync_ = true;
  bool empty_micro_batch_ = false;  // the current micro-batch holds no samples
  float scale_ = 1.0f;
  float loss_scale_ = 1.0f;  // loss_gradient_scale() of the current micro-batch
  bool first_launch_seen_ = false;
  Clock::time_point first_launch_;
  ReducerStepStats last_step_;
  ReducerTotals totals_;
  // This rank's wait in the last synchronized micro-batch, in ns; -1 before the first and
  // on a GPU (Note [Every rank's wait] in step_exchange.cpp).
  int64_t last_wait_ns_ = -1;
};

}  // namespace mtrain
