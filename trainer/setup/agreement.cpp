#include "trainer/setup/agreement.h"

#include <fmt/format.h>

namespace mtrain {

// A streamed set's images are not read to fingerprint it: its labels and each image's
// stored size stand in for them (a shard set copied whole keeps both).
std::string dataset_fingerprint(const data::Dataset& d) {
  uint64_t h = fnv1a(d.labels().data(), d.labels().size() * sizeof(int64_t));
  if (d.in_memory()) {
    h = fnv1a(d.pixels().data(), d.pixels().size(), h);
  } else {
    for (int64_t i = 0; i < d.size(); ++i) {
      const uint64_t size = d.encoded()->image(i).size;
      h = fnv1a(&size, sizeof size, h);
    }
  }
  return fmt::format("{:016x}", h);
}

std::vector<NamedHash> training_configuration(const TrainOptions& o, int64_t train_size, const std::string& fingerprint,
                                              const Device& device) {
  std::vector<NamedHash> items;
  const auto add = [&](const char* name, const std::string& value) {
    items.push_back({name, fnv1a(value), value});
  };
  // What the flags do not say: the data the ranks read, and the device each trains on
  // (replicas on different kinds of device would round differently and drift apart).
  add("training set size", std::to_string(train_size));
  add("training set fingerprint", fingerprint);
  add("the training device (--device)", device.is_cuda() ? "cuda" : "cpu");
  for (const ComparedFlag& flag : flags_ranks_compare(o)) {
    items.push_back({flag.name, fnv1a(flag.value), flag.value});
  }
  return items;
}

// Note [What a resume must match]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Unlike training_configuration, the backend, bucket cap and timeouts are not in (they
// change how the sums travel, not what they are), nor the world size: a checkpoint may be
// resumed by another number of ranks, which continue the epoch where the old world left
// it (Note [Resuming in another world] in loop/train_loop.cpp). The length of the run (--epochs, --max-steps) only
// matters when the learning-rate schedule depends on it: with a constant rate a
// finished run can be extended by resuming it with a larger --epochs or --max-steps.
RunConfiguration resume_configuration(const TrainOptions& o, int64_t train_size, const std::string& fingerprint) {
  RunConfiguration items = {
      {"--model", o.model},
      {"--dataset", o.dataset},
      {"training set size", std::to_string(train_size)},
      {"training set fingerprint", fingerprint},
      {"--batch-size", o.global_batch_size ? "unused" : std::to_string(o.batch_size)},
      {"--global-batch-size", o.global_batch_size ? std::to_string(*o.global_batch_size) : "unset"},
      {"--grad-accum", std::to_string(o.grad_accum)},
      {"--lr", fmt::format("{}", o.lr)},
      {"--momentum", fmt::format("{}", o.momentum)},
      {"--weight-decay", fmt::format("{}", o.weight_decay)},
      {"--nesterov", o.nesterov ? "on" : "off"},
      {"--seed", std::to_string(o.seed)},
      {"--no-shuffle", o.shuffle ? "off" : "on"},
      {"--shuffle-order", o.shuffle_order.text},
      {"--drop-last", o.drop_last ? "on" : "off"},
      {"--random-crop", o.random_crop ? std::to_string(*o.random_crop) : "unset"},
      {"--random-flip", o.random_flip ? "on" : "off"},
      {"--normalize", o.normalize.text},
      {"--resize", o.resize.text},
      {"--random-resized-crop", o.random_resized_crop ? std::to_string(*o.random_resized_crop) : "unset"},
      {"--center-crop", o.center_crop ? std::to_string(*o.center_crop) : "unset"},
      {"--shuffle-buffer", std::to_string(o.shuffle_buffer)},
      {"--full-decode", o.full_decode ? "on" : "off"},
      {"--synthetic-shape", o.synthetic_shape.text},
      {"--sync-bn", o.sync_bn ? "on" : "off"},
      {"--lr-scaling", o.lr_scaling.text},
      {"--warmup-epochs", fmt::format("{}", o.warmup_epochs)},
      {"--lr-schedule", o.lr_schedule.text},
      {"--amp", o.amp.text},
      {"--loss-scale", uses_loss_scaler(o) ? "dynamic" : "none"},
      {"--grad-compression", o.grad_compression.text},
  };
  // When the scale grows decides which later steps overflow and are skipped.
  if (uses_loss_scaler(o)) {
    items.emplace_back("--loss-scale-growth-interval", std::to_string(o.loss_scale_growth_interval));
  }
  if (o.lr_schedule.value != LrScheduleKind::Constant) {
    items.emplace_back("--epochs", std::to_string(o.epochs));
    items.emplace_back("--max-steps", o.max_steps ? std::to_string(*o.max_steps) : "unset");
  }
  return items;
}

// Note [Which flags must agree]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A flag given to some ranks only either changes what is trained (the replicas drift
// apart) or the sequence of collectives (a rank waits in an operation its peers never
// start, until --timeout). Both kinds are compared at start-up (training_configuration).
// The flags that change neither may differ from rank to rank. Which kind a flag is, its row
// in the flag table says (FlagAgreement, Note [One table of flags] in trainer/options.cpp),
// each with its reason, so a new flag cannot be added without deciding.

}  // namespace mtrain
