#include "trainer/ddp/step_exchange.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/error.h"

namespace mtrain {

namespace {

std::string steps_text(int64_t n) { return fmt::format("{} {}", n, n == 1 ? "step" : "steps"); }

}  // namespace

// Note [Every rank's wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Rank 0's wait after backward (the Reducer's, GradientSynchronizer::last_wait_ns) mixes two costs: communication that backward did not hide, and
// time spent while a slower rank was still in its backward (the last bucket's all-reduce cannot
// finish before the last rank launches it). They call for different remedies (bucket sizes, a
// faster link; or finding what slows that rank), and one rank cannot tell them apart. The rank
// that finishes backward last can: its peers are done, so all it waits for is communication. So
// each step's exchange carries every rank's wait of the step before, and rank 0 sums them
// (RankWaits): per rank the wait, per rank the steps in which it waited least (it was the step's
// slowest rank), and the per-step minimum over the ranks, the communication no rank hid. The mean
// wait less that minimum is the time ranks spent waiting for the slowest. The figures run one
// step behind (the last step's waits never travel), cost 8 bytes per rank on an exchange that
// happens anyway, and are not measured when the buckets are awaited on a GPU (there the host's
// wait is not the communication's).
//
// What the split does not see: waiting anywhere else. Without --sync-bn, the buffer broadcast
// before forward (models with BatchNorm) lines the ranks up again, so an imbalance in data loading
// is spent there and not seen here; so is SyncBatchNorm's per-layer waiting (its own metric). With
// --grad-compression the conversion back to float32 counts as communication. With many noisy
// ranks the per-step minimum tends low: some rank is usually lucky.
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

// Note [Agreeing to stop]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A stop signal (Note [Stopping on a signal] in stop_signals.cpp) reaches the ranks at slightly
// different moments, or only one of them, yet every rank must stop after the same optimizer step,
// or the ones that carry on wait forever in the next all-reduce. The last micro-batch of every
// step carries this rank's stop vote (Note [Stop votes] in stop_signals.cpp): issue()
// all-gathers every rank's record on the control group while the backward runs, and finish()
// waits for it after the buckets, so the agreement costs no extra round trip. A rank whose loss
// is not finite votes to stop too (Note [Agreeing to diverge] in trainer/loop/train_loop.cpp), so
// a rank issues once it has read its loss. The same record carries the rank's compute time of
// its previous step for --balance (Note [Measuring each rank's speed] in share_policy.cpp), its
// wait (Note [Every rank's wait]) and its sample count (Note [Ranks that split differently]).
// After the step every rank reads the same agreed_stop_vote(), the largest vote: a vote cast at
// step N is honoured after step N on every rank. In a world of one the agreed vote is the local
// one.
//
// Note [Ranks that split differently]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every rank computes the split of each global batch by itself (Note [Shares by integer
// arithmetic] in data/distributed_sampler.cpp). Should two ranks not agree (a build that computes
// differently on some host), their chunks would no longer tile the global batch, and the loss
// gradient scale would rest on a total the micro-batches do not hold. The step's exchange carries
// every rank's count; where they do not add up to this rank's planned total, the step ends in an
// error before the optimizer applies it: better to stop than to train on images skipped or read
// twice. (With three or more ranks two could disagree on a boundary with equal totals; that this
// check does not see.)

// Note [The exchange's place in the step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On Gloo and MPI the exchange shares its group with the gradient buckets (the control group is
// the gradient group there, Note [Control-plane collectives] in training_groups.cpp), and a
// group's collectives must be issued in one order on every rank: a rank that sends its record
// before its buckets while a peer sends it after them pairs an all-gather with an all-reduce, an
// error or a hang until the timeout (the tests show both orders working and a mixed one failing).
// So the exchange has one place in the step, decided by the device alone, and the ranks train on
// one kind of device (Note [Agreeing on the backend first] in training_groups.cpp):
// - On the CPU the loss is on the host when the forward returns, so the record goes out before
//   the backward, ahead of every bucket, and its round trip hides behind the backward. Issued
//   after it, behind the last bucket, the round trip cost the 2-rank LeNet step 0.9 ms on the
//   2-core VM (docs/benchmarks.md).
// - From a GPU the loss is read once the backward is queued (Note [The loss is read after
//   backward is queued] in trainer/loop/train_loop.cpp), so the record goes out then, after every
//   bucket's launch, and travels while the GPU runs the backward. (Under NCCL the control group
//   is a Gloo group of its own; under Gloo on GPUs it is the gradient group, as on the CPU.)
// A rank with an empty micro-batch keeps the same place: its skipped backward launches the
// buckets where a backward would (Reducer::skip_backward). finish() comes after the buckets'
// wait on every device; the exchange is small, so waiting for it last costs nothing.
StepExchange::StepExchange(std::shared_ptr<ProcessGroup> control, Device compute)
    : control_(std::move(control)), compute_(compute) {}

void StepExchange::issue(const StepReport& report, const MicroBatchInfo& micro_batch, int64_t previous_wait_ns) {
  MTRAIN_CHECK(!issued_, "the step exchange was issued twice for one micro-batch");
  MTRAIN_CHECK(micro_batch.sync, "the step exchange goes with a synchronized micro-batch only");
  issued_ = true;
  world_samples_ = micro_batch.world_samples;
  mine_ = Tensor::from_vector<int64_t>({report.stop_vote, previous_wait_ns, report.previous_compute.nanoseconds,
                                        report.previous_compute.images, micro_batch.samples},
                                       {kFields});
  if (control_ == nullptr) return;
  all_ = Tensor::empty({kFields * static_cast<int64_t>(control_->size())}, DType::Int64);
  work_ = control_->allgather(mine_, all_);
}

void StepExchange::finish() {
  MTRAIN_CHECK(issued_, "a synchronized micro-batch ended its backward without the step exchange");
  issued_ = false;
  if (control_ == nullptr) {
    read(mine_.data<int64_t>(), 1);
    return;
  }
  WorkPtr work = std::move(work_);
  work->wait(control_->options().timeout);
  read(all_.data<int64_t>(), static_cast<size_t>(control_->size()));
}

void StepExchange::read(const int64_t* records, size_t world) {
  agreed_stop_vote_ = records[0];
  std::vector<double> waits(world);
  std::vector<int64_t> samples(world);
  ranks_compute_.assign(world, RankCompute{});
  bool every_rank_measured = true;
  for (size_t r = 0; r < world; ++r) {
    const int64_t* fields = records + kFields * r;
    agreed_stop_vote_ = std::max(agreed_stop_vote_, fields[0]);
    every_rank_measured = every_rank_measured && fields[1] >= 0;
    waits[r] = static_cast<double>(fields[1]) * 1e-9;
    ranks_compute_[r] = {fields[2], fields[3]};
    samples[r] = fields[4];
  }
  // Note [Every rank's wait]: none before the first step, none on a GPU.
  if (every_rank_measured) rank_waits_.add_step(waits);
  if (!world_samples_) return;
  int64_t held = 0;
  for (int64_t n : samples) held += n;
  if (held != *world_samples_) {
    throw InternalError(fmt::format(
        "the ranks' micro-batches held {} images together ({} by rank) where this rank's split of the global batch "
        "has {}: the ranks split the global batch differently",
        held, fmt::join(samples, ", "), *world_samples_));
  }
}

}  // namespace mtrain
