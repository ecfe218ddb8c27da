// BatchResplitter: --balance in a running job. After every step it hands the step's exchanged compute
// times (StepExchange::ranks_compute) to a SharePolicy and, when the shares move,
// re-splits the later global batches in the sampler and re-plans the loader (Note [Shares that
// change mid-epoch] in data/distributed_sampler.cpp), logs why and writes a "balance" metrics
// event. Every rank runs it on the same figures, so every rank moves its shares at the same step.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "data/dataloader.h"
#include "data/distributed_sampler.h"
#include "trainer/ddp/step_exchange.h"
#include "trainer/ddp/share_policy.h"
#include "trainer/loop/metrics.h"

namespace mtrain {

class BatchResplitter {
 public:
  // Everything must outlive this object; `sampler` must be the one `loader` reads, already
  // splitting by the balancer's initial shares (InternalError otherwise).
  BatchResplitter(SharePolicy balancer, data::GlobalBatchShardSampler& sampler, data::DataLoader& loader,
               const StepExchange& exchange, MetricsWriter& metrics);

  // After optimizer step `step` (1-based over the run), with `batches_taken` batches of the
  // epoch taken: reads the step's exchange and applies a change from batch batches_taken + 1.
  void after_step(int64_t step, int64_t batches_taken);
  // Adds "shares" to a step or epoch metrics event.
  void add_fields(nlohmann::json& event) const;
  // The end-of-run line: the shares, their changes, and the time saved against the even split.
  std::string summary() const;

 private:
  void apply(const ShareChange& change, int64_t step, int64_t from_batch);

  SharePolicy balancer_;
  data::GlobalBatchShardSampler& sampler_;
  data::DataLoader& loader_;
  const StepExchange& exchange_;
  MetricsWriter& metrics_;
};

}  // namespace mtrain
