#include "trainer/ddp/reducer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/trace.h"
#include "tensor/ops.h"
#include "trainer/ddp/rank_consensus.h"

namespace mtrain {

namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double mib(size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Share of the all-reduce span that did not show up as waiting after backward.
double hidden_fraction(double wait_seconds, double span_seconds) {
  if (span_seconds <= 0.0) return 0.0;
  return std::clamp(1.0 - wait_seconds / span_seconds, 0.0, 1.0);
}

}  // namespace

double ReducerTotals::hidden_fraction() const { return mtrain::hidden_fraction(wait_seconds, comm_span_seconds); }

Reducer::Reducer(std::shared_ptr<ProcessGroup> group, ReducerOptions options, std::shared_ptr<ProcessGroup> control)
    : group_(std::move(group)), options_(options), control_(std::move(control)) {
  MTRAIN_CHECK(group_ != nullptr, "Reducer needs a process group");
  if (control_ == nullptr) control_ = group_;
  MTRAIN_CHECK(control_->size() == group_->size() && control_->rank() == group_->rank(),
               "control group is rank {} of {}, the gradient group rank {} of {}", control_->rank(),
               control_->size(), group_->rank(), group_->size());
  if (options_.bucket_cap_bytes == 0) {
    throw InvalidArgument("--bucket-cap-mb: expected a size > 0 bytes, found 0");
  }
}

// Note [Reducer buckets]
// ~~~~~~~~~~~~~~~~~~~~~~
// Parameters are packed into buckets in reverse registration order (roughly the order backward
// finishes their gradients): a small first bucket (kFirstBucketBytes) so the first all-reduce
// starts early, then buckets of up to --bucket-cap-mb. A parameter larger than the cap gets a
// bucket of its own. The layout depends only on the parameter list and the caps, so attach()
// all-gathers a hash of it: a rank with a different model or cap fails at once with the ranks
// named (Note [Consensus by hashes] in rank_consensus.cpp), never later inside a mismatched
// all-reduce.
//
// Note [Gradients are views into the buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every parameter's gradient is re-seated as a view into its bucket (PyTorch's
// gradient_as_bucket_view=True): layers accumulate straight into the bucket, a launch scales and
// all-reduces it in place, and nothing is copied back. That saves a second copy of every gradient
// (45 MiB for ResNet-18) and two passes over them per step. Each view starts on a 64-byte
// boundary (next_gradient_offset); the gaps hold zeros, which the all-reduce sums with the rest.
// Under no_sync (--grad-accum) the views accumulate like any gradient. Whoever holds a Parameter must read `grad` through it rather than
// keep an old Tensor handle (the optimizer and the layers do).
//
// A rank whose micro-batch is empty (a --global-batch-size chunk that torch.chunk leaves empty,
// e.g. G = 5 on 4 ranks, or an epoch's small last batch) runs no backward; the loop calls
// skip_backward() in its place, which launches every bucket (zeros, with weight 0) there, so
// the buckets come in the same order as on the ranks that ran one, before or after the step's
// exchange (Note [The exchange's place in the step] in step_exchange.cpp).
void Reducer::attach(models::Module& model) {
  names_.clear();
  params_.clear();
  const auto named = model.parameters();
  device_ = named.empty() ? Device::cpu() : named.front().param->value.device();
  for (const auto& p : named) {
    names_.push_back(p.name);
    params_.push_back(p.param);
    MTRAIN_CHECK(p.param->value.dtype() == DType::Float32, "parameter {} is {}, the reducer handles float32",
                 p.name, p.param->value.str());
    if (p.param->value.device() != device_ || p.param->grad.device() != device_) {
      throw InvalidArgument(fmt::format(
          "the DDP reducer needs every parameter and gradient on one device: {} is on {} (its gradient on {}), "
          "{} on {}; move the whole model with model.to(device) before attaching the reducer",
          p.name, p.param->value.device().str(), p.param->grad.device().str(), named.front().name,
          device_.str()));
    }
  }
  const int n = static_cast<int>(params_.size());
  bucket_of_.assign(n, -1);
  bucket_params_.clear();
  buckets_.clear();

  // Reverse registration order, first bucket small, the rest up to the cap.
  size_t bucket_bytes = 0;
  for (int i = n - 1; i >= 0; --i) {
    const size_t bytes = params_[i]->value.nbytes();
    // The bucket being filled is the first one while there is at most one.
    const size_t limit = bucket_params_.size() <= 1 ? options_.first_bucket_bytes : options_.bucket_cap_bytes;
    if (bucket_params_.empty() || (bucket_bytes > 0 && bucket_bytes + bytes > limit)) {
      bucket_params_.emplace_back();
      bucket_bytes = 0;
    }
    bucket_params_.back().push_back(i);
    bucket_bytes += bytes;
  }
  uint64_t layout = fnv1a("buckets");
  uint64_t shapes = fnv1a("parameters");
  for (int i = 0; i < n; ++i) {
    shapes = fnv1a(names_[i], shapes);
    const auto& shape = params_[i]->value.shape();
    shapes = fnv1a(shape.data(), shape.size() * sizeof(shape[0]), shapes);
  }
  for (size_t b = 0; b < bucket_params_.size(); ++b) {
    Bucket bucket;
    bucket.params = bucket_params_[b];
    int64_t total = 0;
    for (int i : bucket.params) {
      bucket_of_[i] = static_cast<int>(b);
      bucket.offsets.push_back(total);
      total = next_gradient_offset(total, params_[i]->value.numel());
    }
    bucket.flat = Tensor::zeros({total}, DType::Float32, device_);
    if (options_.compression != DType::Float32) bucket.wire = Tensor::empty({total}, options_.compression, device_);
    // Note [Gradients are views into the buckets]: from here on each gradient lives in
    // its bucket, so launching a bucket needs no copy in and the wait no copy out.
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      seat_gradient(*params_[bucket.params[k]], bucket.flat, bucket.offsets[k]);
    }
    layout = fnv1a(bucket.params.data(), bucket.params.size() * sizeof(int), layout);
    layout = fnv1a(&total, sizeof total, layout);
    buckets_.push_back(std::move(bucket));
  }
  require_same_on_all_ranks(*control_,
                            {{"the model's parameters (names and shapes)", shapes,
                              fmt::format("{} parameter tensors", n)},
                             {"the gradient bucket layout", layout,
                              fmt::format("{} buckets", buckets_.size())}},
                            "the DDP setup");
  ready_count_.assign(n, 0);
  model.set_grad_ready_hook([this](models::Parameter& p) { on_gradient_ready(p); });
  attached_ = true;
}

void Reducer::zero_gradients() {
  MTRAIN_CHECK(attached_, "zero_gradients before attach");
  for (Bucket& b : buckets_) {
    for (const int i : b.params) check_seated(*params_[i], names_[i], b.flat);
    b.flat.zero_();
  }
}

// Note [Reducer gradient weighting]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each rank's gradient is the mean over its own micro-batch. Pre-scaling by 1/W and summing gives
// the mean over all ranks' samples when every rank has the same count (PyTorch's DDP divides the
// same way). Pre-scaling rather than dividing after the sum keeps the values in range and costs
// nothing extra: the launch does it in place.
//
// With uneven per-rank counts (--global-batch-size) the loop scales the loss gradient by
// W * count_r / total (loss_gradient_scale()), where total is the step's global batch as every
// rank's sampler plans it (MicroBatchInfo::world_samples). Asking the other ranks instead (an
// all-reduce of the counts) would be a barrier between forward and backward: with ranks of
// different speed (--balance) the faster one waited there for the slower one's forward, and again
// after backward for its backward, losing whatever the two phases' imbalances could cancel. The
// counts travel with the step's exchange instead, and after backward every rank checks they add up
// to its total (Note [Ranks that split differently] in step_exchange.cpp). Every rank's loss
// gradient is then W times the gradient of the global mean loss, the same scale everywhere, and
// the 1/W pre-scale and the sum give exactly the single-process gradient. Scaling the buckets by
// count_r / total instead would be right for layers that see only their own rank's samples, but
// not through SyncBatchNorm: its backward sums dy over the ranks before any bucket exists, and a
// rank with 2 of 10 images would weigh its dy 2x in those sums (the resnet18 --sync-bn test on 3
// ranks with shares 4, 4, 2 checks this against one rank).
void Reducer::before_backward(const MicroBatchInfo& micro_batch) {
  std::fill(ready_count_.begin(), ready_count_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.work.reset();
  }
  params_pending_ = static_cast<int>(params_.size());
  next_launch_ = 0;
  sync_ = micro_batch.sync;
  empty_micro_batch_ = micro_batch.samples == 0;
  first_launch_seen_ = false;
  last_step_ = ReducerStepStats{};
  // The count weighting is per micro-batch; accumulated micro-batches would need one
  // weight each (options.cpp refuses --global-batch-size with --grad-accum > 1).
  MTRAIN_CHECK(sync_ || !options_.weight_by_sample_count,
               "the reducer weights gradients by sample count, which needs every micro-batch synchronized");
  if (!sync_) return;
  const int world = group_->size();
  scale_ = 1.0f / static_cast<float>(world);
  loss_scale_ = 1.0f;
  if (options_.weight_by_sample_count) {
    // Note [Reducer gradient weighting]
    MTRAIN_CHECK(micro_batch.world_samples.has_value(),
                 "the reducer weights gradients by sample count, which needs the step's total samples");
    const int64_t total = *micro_batch.world_samples;
    if (total <= 0) {
      throw InvalidArgument(fmt::format("every rank's micro-batch is empty (total 0 samples) at this step"));
    }
    loss_scale_ = static_cast<float>(static_cast<double>(world) * static_cast<double>(micro_batch.samples) /
                                     static_cast<double>(total));
    // An empty rank runs no backward; its buckets (zeros) go out with weight 0.
    if (micro_batch.samples == 0) scale_ = 0.0f;
  }
}

// Note [Reducer launch order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The grad-ready hook marks a parameter ready; a bucket is ready when all of its parameters are.
// Inside a Residual block hooks do not fire in reverse registration order, so bucket k may become
// ready before bucket k-1. Collectives must be issued in the same order on every rank, so buckets
// launch strictly in index order: a ready bucket whose predecessors have not launched waits, and
// launches (from the hook that completes its last predecessor) the moment they have. A launch
// scales the bucket by the rank's weight and starts an asynchronous all-reduce (sum) that runs on
// the process group's thread while backward goes on with earlier layers.
void Reducer::on_gradient_ready(models::Parameter& param) {
  MTRAIN_CHECK(param.index >= 0 && static_cast<size_t>(param.index) < ready_count_.size(),
               "grad-ready hook for parameter index {} of a model with {} parameters", param.index,
               ready_count_.size());
  if (++ready_count_[param.index] != 1) return;  // after_backward reports the duplicate
  --params_pending_;
  if (!sync_) return;
  Bucket& bucket = buckets_[bucket_of_[param.index]];
  if (--bucket.pending == 0) launch_ready_buckets();
}

void Reducer::skip_backward() {
  MTRAIN_CHECK(empty_micro_batch_, "skip_backward for a micro-batch that holds samples");
  for (auto* p : params_) on_gradient_ready(*p);
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    launch(buckets_[next_launch_]);
    last_step_.launches.push_back({static_cast<int>(next_launch_), params_pending_});
    ++next_launch_;
  }
}

// Note [Gradient compression]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// --grad-compression bf16|fp16 is PyTorch DDP's bf16_compress_hook / fp16_compress_hook: each
// bucket, once scaled, is converted to the 16-bit type (round to nearest even) into a wire buffer
// of its own, the all-reduce sums the wire buffers in that type (Note [Half-precision reductions]
// in collectives/half_math.cpp; NCCL natively), and after the wait the result is converted back
// into the bucket, so every gradient the optimizer sees is float32 again. Half the bytes travel,
// at the price of a 16-bit rounding of each rank's gradient and of every partial sum. Every rank
// receives the same sum, so the replicas stay bitwise identical. float16 keeps 11 significant bits
// but flushes values below 2^-24 to zero (its loss scaling, Note [Dynamic loss scaling], applies
// before the buckets are reduced); bfloat16 keeps float32's range and 8 significant bits.
void Reducer::launch(Bucket& bucket) {
  bucket.launched_at = Clock::now();
  if (!first_launch_seen_) {
    first_launch_seen_ = true;
    first_launch_ = bucket.launched_at;
  }
  // The gradients are the bucket (Note [Gradients are views into the buckets]): scale
  // them in place (a pass over every gradient, skipped when it would multiply by 1), then
  // reduce in place.
  if (scale_ != 1.0f) ops::scale_(bucket.flat, scale_);
  if (alone()) return;  // Note [A group of one reduces nothing]
  if (bucket.wire.defined()) {
    ops::convert(bucket.flat, bucket.wire);  // Note [Gradient compression]
    bucket.work = group_->allreduce(bucket.wire, ReduceOp::Sum);
  } else {
    bucket.work = group_->allreduce(bucket.flat, ReduceOp::Sum);
  }
}

// Note [A group of one reduces nothing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In a group of one (a one-rank NCCL group: `--backend nccl` in a world of one, the d2l
// recipe's set-up) a bucket's all-reduce is the bucket itself, so a float32 bucket sends
// nothing: no launch on the group's stream, no events, no wait (PyTorch's DDP all-reduces
// anyway). The bookkeeping (launch order, statistics) stays. That leaves the backward
// with no host wait and no other stream, so a CUDA graph can hold it (capturable()).
// With --grad-compression the bucket still makes its round trip through 16 bits, which
// changes its values, and so still travels.
bool Reducer::alone() const { return group_->size() == 1 && options_.compression == DType::Float32; }

bool Reducer::capturable() const { return alone() && !options_.weight_by_sample_count; }

void Reducer::backward_replayed() {
  MTRAIN_CHECK(capturable(), "{}: a replayed backward, but this reducer cannot be captured", describe());
  // The launches below queue nothing: a group of one scales by 1 and sends nothing.
  MTRAIN_CHECK(scale_ == 1.0f, "a replayed backward with the buckets scaled by {}", scale_);
  for (auto* p : params_) on_gradient_ready(*p);
}

// Note [Reducer statistics]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Per synchronized step: the time after_backward waits for the all-reduces (communication not
// hidden behind backward), the span from the first launch until all are done, and the fraction
// hidden = 1 - wait / span. Per bucket: the launch order and how many parameters still lacked
// their gradient at the launch. A positive count proves the all-reduce overlapped backward, an
// ordering fact the overlap test can check without a timing threshold.
//
// On a GPU the host's wait is not the communication's, so hidden_fraction is not measured:
// waited_on_device says so, and the metrics report null rather than a flattering 1. The launch
// order and params_pending stay exact.
//
// Note [Reducer on a GPU]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The buckets live on the parameters' device (attach() requires one device for all of them), so
// gradients are views into GPU memory and a launch is a GPU kernel (ops::scale_) followed by the
// all-reduce, which the process group orders after the work queued on the current stream.
// after_backward then calls Work::wait_on_current_stream() for each bucket: it returns at once and
// the optimizer step queued next runs after the all-reduces on the GPU, so the host never blocks
// on communication (Note [Asynchronous collectives] in collectives/process_group.cpp); its
// wait_seconds is next to nothing. A failed all-reduce surfaces through the group
// (a later wait, the next operation or its watchdog at the deadline) rather than in this call.
void Reducer::after_backward() {
  for (size_t i = 0; i < ready_count_.size(); ++i) {
    if (ready_count_[i] != 1) {
      throw InternalError(fmt::format(
          "parameter {} reported its gradient ready {} times in one backward (expected once): every parameter "
          "must take part in every forward, or the ranks' all-reduces would not match",
          names_[i], ready_count_[i]));
    }
  }
  if (!sync_) return;
  MTRAIN_CHECK(next_launch_ == buckets_.size(), "{} of {} gradient buckets were launched", next_launch_,
               buckets_.size());
  const auto backward_end = Clock::now();
  last_step_.waited_on_device = device_.is_cuda();
  for (auto& b : buckets_) {
    if (b.work == nullptr) continue;  // Note [A group of one reduces nothing]
    if (last_step_.waited_on_device) {
      b.work->wait_on_current_stream();  // Note [Reducer on a GPU]
    } else {
      b.work->wait(group_->options().timeout);
    }
    // On a GPU queued after the wait on the current stream, like the optimizer step.
    if (b.wire.defined()) ops::convert(b.wire, b.flat);
  }
  const auto all_done = Clock::now();
  trace_buckets(all_done);
  last_step_.wait_seconds = seconds_between(backward_end, all_done);
  last_step_.comm_span_seconds = seconds_between(first_launch_, all_done);
  last_step_.hidden_fraction = last_step_.waited_on_device
                                    ? 0.0
                                    : hidden_fraction(last_step_.wait_seconds, last_step_.comm_span_seconds);
  ++totals_.synced_steps;
  totals_.wait_seconds += last_step_.wait_seconds;
  totals_.comm_span_seconds += last_step_.comm_span_seconds;
  last_wait_ns_ =
      last_step_.waited_on_device ? -1 : static_cast<int64_t>(std::llround(last_step_.wait_seconds * 1e9));
}

void Reducer::trace_buckets(Clock::time_point all_done) const {
  if (!trace::recording()) return;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const Bucket& b = buckets_[k];
    // On a GPU the host did not wait (Note [Reducer on a GPU]): an all-reduce still running
    // ends at the moment its wait was queued, so there the spans understate communication.
    const Clock::time_point done = b.work != nullptr ? b.work->completed_at().value_or(all_done) : b.launched_at;
    trace::record("all-reduce", "comm", trace::bucket_row(static_cast<int>(k)), b.launched_at,
                  std::max(done, b.launched_at), "bytes", static_cast<int64_t>(b.flat.nbytes()));
  }
}

std::string Reducer::describe() const {
  size_t bytes = 0;
  for (const auto& b : buckets_) bytes += b.flat.nbytes();
  return fmt::format("DDP reducer over {} ranks ({}): {} parameter tensors in {} buckets on {} ({:.2f} MiB, "
                     "first bucket {:.2f} MiB, cap {:.2f} MiB){}{}",
                     group_->size(), group_->backend_name(), params_.size(), buckets_.size(), device_.str(),
                     mib(bytes), mib(options_.first_bucket_bytes), mib(options_.bucket_cap_bytes),
                     options_.weight_by_sample_count ? ", gradients weighted by per-rank sample counts" : "",
                     options_.compression != DType::Float32
                         ? fmt::format(", all-reduced in {}", dtype_name(options_.compression))
                         : "");
}

}  // namespace mtrain
