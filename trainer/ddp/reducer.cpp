#include "trainer/ddp/reducer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "tensor/ops.h"
#include "trainer/ddp/rank_consensus.h"

namespace mtrain {

namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double mib(size_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::string steps_text(int64_t n) { return fmt::format("{} {}", n, n == 1 ? "step" : "steps"); }

// Share of the all-reduce span that did not show up as waiting after backward.
double hidden_fraction(double wait_seconds, double span_seconds) {
  if (span_seconds <= 0.0) return 0.0;
  return std::clamp(1.0 - wait_seconds / span_seconds, 0.0, 1.0);
}

}  // namespace

void RankWaits::add_step(const std::vector<double>& waits) {
  MTRAIN_CHECK(!waits.empty(), "a step's waits name no rank");
  if (steps == 0) {
    wait_seconds.assign(waits.size(), 0.0);
    slowest_steps.assign(waits.size(), 0);
  }
  MTRAIN_CHECK(waits.size() == wait_seconds.size(), "a step's waits name {} ranks, earlier steps {}", waits.size(),
               wait_seconds.size());
  size_t slowest = 0;
  for (size_t r = 0; r < waits.size(); ++r) {
    wait_seconds[r] += waits[r];
    if (waits[r] < waits[slowest]) slowest = r;
  }
  ++slowest_steps[slowest];
  exposed_seconds += waits[slowest];
  ++steps;
}

double RankWaits::mean_wait_seconds() const {
  if (steps == 0) return 0.0;
  double sum = 0.0;
  for (double w : wait_seconds) sum += w;
  return sum / static_cast<double>(wait_seconds.size()) / static_cast<double>(steps);
}

std::string describe_rank_waits(const RankWaits& waits) {
  if (waits.steps == 0) return "after backward: no step's waits were reported by every rank yet";
  const double mean = waits.mean_wait_seconds();
  const double exposed = waits.exposed_seconds / static_cast<double>(waits.steps);
  std::vector<size_t> ranks;
  for (size_t r = 0; r < waits.slowest_steps.size(); ++r) {
    if (waits.slowest_steps[r] > 0) ranks.push_back(r);
  }
  std::stable_sort(ranks.begin(), ranks.end(),
                   [&](size_t a, size_t b) { return waits.slowest_steps[a] > waits.slowest_steps[b]; });
  constexpr size_t kNamed = 3;
  std::string slowest;
  for (size_t k = 0; k < std::min(ranks.size(), kNamed); ++k) {
    const int64_t n = waits.slowest_steps[ranks[k]];
    slowest += k == 0 ? fmt::format("rank {} in {}", ranks[k], steps_text(n))
                      : fmt::format(", rank {} in {}", ranks[k], n);
  }
  if (ranks.size() > kNamed) {
    int64_t rest = 0;
    for (size_t k = kNamed; k < ranks.size(); ++k) rest += waits.slowest_steps[ranks[k]];
    slowest += fmt::format(", {} more ranks in {}", ranks.size() - kNamed, rest);
  }
  return fmt::format(
      "after backward the {} ranks waited {:.3f} s per step on average over {}: {:.3f} s for communication "
      "that no rank hid, {:.3f} s for the slowest rank to finish its backward (slowest: {})",
      waits.wait_seconds.size(), mean, steps_text(waits.steps), exposed, std::max(mean - exposed, 0.0), slowest);
}

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
      total += params_[i]->value.numel();
    }
    bucket.flat = Tensor::zeros({total}, DType::Float32, device_);
    if (options_.compression != DType::Float32) bucket.wire = Tensor::empty({total}, options_.compression, device_);
    // Note [Gradients are views into the buckets]: from here on each gradient lives in
    // its bucket, so launching a bucket needs no copy in and the wait no copy out.
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      models::Parameter& p = *params_[bucket.params[k]];
      Tensor view = bucket.flat.flat_view(bucket.offsets[k], p.value.shape());
      view.copy_(p.grad);
      p.grad = view;
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
}

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
  // Issued first, so it travels ahead of the buckets and is done by the time they are.
  const int world = group_->size();
  exchange_mine_ = Tensor::from_vector<int64_t>({micro_batch.stop_vote, previous_wait_ns_}, {2});
  exchange_all_ = Tensor::empty({2 * static_cast<int64_t>(world)}, DType::Int64);
  exchange_work_ = control_->allgather(exchange_mine_, exchange_all_);
  scale_ = 1.0f / static_cast<float>(world);
  loss_scale_ = 1.0f;
  if (options_.weight_by_sample_count) {
    // Note [Reducer gradient weighting]
    Tensor count = Tensor::from_vector<int64_t>({micro_batch.samples}, {1});
    control_->allreduce(count, ReduceOp::Sum)->wait();
    const int64_t total = count.data<int64_t>()[0];
    if (total <= 0) {
      throw InvalidArgument(fmt::format("every rank's micro-batch is empty (total 0 samples) at this step"));
    }
    loss_scale_ = static_cast<float>(static_cast<double>(world) * static_cast<double>(micro_batch.samples) /
                                     static_cast<double>(total));
    // An empty rank runs no backward; its buckets (zeros) go out with weight 0.
    if (micro_batch.samples == 0) scale_ = 0.0f;
  }
}

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

void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    launch(buckets_[next_launch_]);
    last_step_.launches.push_back({static_cast<int>(next_launch_), params_pending_});
    ++next_launch_;
  }
}

void Reducer::launch(Bucket& bucket) {
  if (!first_launch_seen_) {
    first_launch_seen_ = true;
    first_launch_ = Clock::now();
  }
  // The gradients are the bucket (Note [Gradients are views into the buckets]): scale
  // them in place, then reduce in place.
  ops::scale_(bucket.flat, scale_);
  if (bucket.wire.defined()) {
    ops::convert(bucket.flat, bucket.wire);  // Note [Gradient compression]
    bucket.work = group_->allreduce(bucket.wire, ReduceOp::Sum);
  } else {
    bucket.work = group_->allreduce(bucket.flat, ReduceOp::Sum);
  }
}

void Reducer::after_backward() {
  if (empty_micro_batch_) {
    for (auto* p : params_) on_gradient_ready(*p);
  }
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
    if (last_step_.waited_on_device) {
      b.work->wait_on_current_stream();  // Note [Reducer on a GPU]
    } else {
      b.work->wait(group_->options().timeout);
    }
    // On a GPU queued after the wait on the current stream, like the optimizer step.
    if (b.wire.defined()) ops::convert(b.wire, b.flat);
  }
  exchange_work_->wait(control_->options().timeout);
  exchange_work_.reset();
  const auto all_done = Clock::now();
  take_exchange();
  last_step_.wait_seconds = seconds_between(backward_end, all_done);
  last_step_.comm_span_seconds = seconds_between(first_launch_, all_done);
  last_step_.hidden_fraction = last_step_.waited_on_device
                                    ? 0.0
                                    : hidden_fraction(last_step_.wait_seconds, last_step_.comm_span_seconds);
  ++totals_.synced_steps;
  totals_.wait_seconds += last_step_.wait_seconds;
  totals_.comm_span_seconds += last_step_.comm_span_seconds;
  previous_wait_ns_ =
      last_step_.waited_on_device ? -1 : static_cast<int64_t>(std::llround(last_step_.wait_seconds * 1e9));
}

void Reducer::take_exchange() {
  const int64_t* all = exchange_all_.data<int64_t>();
  const size_t world = static_cast<size_t>(exchange_all_.numel() / 2);
  agreed_stop_vote_ = all[0];
  std::vector<double> waits(world);
  bool every_rank_measured = true;
  for (size_t r = 0; r < world; ++r) {
    agreed_stop_vote_ = std::max(agreed_stop_vote_, all[2 * r]);
    every_rank_measured = every_rank_measured && all[2 * r + 1] >= 0;
    waits[r] = static_cast<double>(all[2 * r + 1]) * 1e-9;
  }
  // Note [Every rank's wait]: none before the first step, none on a GPU.
  if (every_rank_measured) rank_waits_.add_step(waits);
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
