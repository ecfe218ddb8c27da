#include "trainer/ddp/batch_resplitter.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <string>
#include <vector>

#include "core/error.h"

namespace mtrain {

namespace {

std::string per_image(const std::vector<double>& seconds) {
  std::string text;
  for (size_t r = 0; r < seconds.size(); ++r) {
    text += fmt::format("{}rank {} {:.2f} ms", r == 0 ? "" : ", ", r, seconds[r] * 1e3);
  }
  return text;
}

}  // namespace

BatchResplitter::BatchResplitter(SharePolicy balancer, data::GlobalBatchShardSampler& sampler, data::DataLoader& loader,
                           const StepExchange& exchange, MetricsWriter& metrics)
    : balancer_(std::move(balancer)), sampler_(sampler), loader_(loader), exchange_(exchange), metrics_(metrics) {
  MTRAIN_CHECK(sampler_.shares() == balancer_.shares(), "the sampler splits by {}, the balancer starts from {}",
               format_shares(sampler_.shares()), format_shares(balancer_.shares()));
}

void BatchResplitter::after_step(int64_t step, int64_t batches_taken) {
  // The exchange of this step carried every rank's compute of the step before.
  const std::vector<RankCompute>& ranks = exchange_.ranks_compute();
  if (spdlog::should_log(spdlog::level::debug)) {
    std::string figures;
    for (const RankCompute& c : ranks) figures += fmt::format(" {:.2f}ms/{}", static_cast<double>(c.nanoseconds) * 1e-6, c.images);
    spdlog::debug("balance: step {} computed{}", step - 1, figures);
  }
  const std::optional<ShareChange> change = balancer_.observe(step - 1, ranks);
  if (change) apply(*change, step, batches_taken + 1);
}

void BatchResplitter::apply(const ShareChange& change, int64_t step, int64_t from_batch) {
  sampler_.set_shares(from_batch, change.after);
  const bool this_epoch = from_batch < sampler_.steps();
  if (this_epoch) loader_.replan(from_batch);
  std::string hopeless;
  for (int r : change.hopeless) {
    hopeless += fmt::format("; rank {} gets no images: one image takes it {:.2f} ms, longer than the others' whole "
                            "step",
                            r, change.seconds_per_image[static_cast<size_t>(r)] * 1e3);
  }
  // Batch from_batch is the step after the next one (the prefetcher may hold the next).
  const std::string from = this_epoch ? fmt::format("from step {}", step + 2) : std::string("from the next epoch");
  spdlog::info("balance: shares {} -> {} {} (per image: {}; predicted compute per step {:.1f} -> {:.1f} ms){}",
               format_shares(change.before), format_shares(change.after), from,
               per_image(change.seconds_per_image), change.predicted_before * 1e3, change.predicted_after * 1e3,
               hopeless);
  metrics_.write({{"event", "balance"},
                  {"step", step},
                  {"measured_step", change.step},
                  {"shares_before", change.before},
                  {"shares", change.after},
                  {"sec_per_image", change.seconds_per_image},
                  {"predicted_sec_before", change.predicted_before},
                  {"predicted_sec", change.predicted_after},
                  {"hopeless_ranks", change.hopeless}});
}

void BatchResplitter::add_fields(nlohmann::json& event) const { event["shares"] = balancer_.shares(); }

std::string BatchResplitter::summary() const {
  const double measured = balancer_.measured_seconds();
  const double even = balancer_.even_split_seconds();
  const std::string changes = balancer_.options().automatic
                                  ? fmt::format("{} change{}", balancer_.changes(), balancer_.changes() == 1 ? "" : "s")
                                  : std::string("fixed");
  if (balancer_.measured_steps() == 0 || even <= 0.0) {
    return fmt::format("balance: shares {} ({}); no step was measured on every rank", format_shares(balancer_.shares()),
                       changes);
  }
  return fmt::format(
      "balance: shares {} ({}); over {} measured steps the slowest rank computed {:.1f} s, the even split would have "
      "taken an estimated {:.1f} s: {:.1f} s ({:.0f} %) saved",
      format_shares(balancer_.shares()), changes, balancer_.measured_steps(), measured, even, even - measured,
      100.0 * (even - measured) / even);
}

}  // namespace mtrain
