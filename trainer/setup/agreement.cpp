#include "trainer/setup/agreement.h"

#include <fmt/format.h>

namespace mtrain {

std::string dataset_fingerprint(const data::Dataset& d) {
  uint64_t h = fnv1a(d.labels().data(), d.labels().size() * sizeof(int64_t));
  h = fnv1a(d.pixels().data(), d.pixels().size(), h);
  return fmt::format("{:016x}", h);
}

std::vector<NamedHash> training_configuration(const TrainOptions& o, int64_t train_size, const std::string& fingerprint,
                                              const Device& device) {
  std::vector<NamedHash> items;
  const auto add = [&](const char* name, const std::string& value) {
    items.push_back({name, fnv1a(value), value});
  };
  add("--model", o.model);
  add("--dataset", o.dataset);
  add("training set size", std::to_string(train_size));
  add("training set fingerprint", fingerprint);
  add("--epochs", std::to_string(o.epochs));
  add("--max-steps", o.max_steps ? std::to_string(*o.max_steps) : "unset");
  add("--batch-size", std::to_string(o.batch_size));
  add("--global-batch-size", o.global_batch_size ? std::to_string(*o.global_batch_size) : "unset");
  // Every rank must split each global batch the same way (and time its steps for auto).
  add("--balance", o.balance);
  add("--lr", fmt::format("{}", o.lr));
  add("--momentum", fmt::format("{}", o.momentum));
  add("--weight-decay", fmt::format("{}", o.weight_decay));
  add("--nesterov", o.nesterov ? "on" : "off");
  add("--seed", std::to_string(o.seed));
  add("--init", o.init);
  // Whether it is given (rank 0's weights are broadcast, so the file may differ): a rank
  // given it alone is told so by name.
  add("--init-from", o.init_from.empty() ? "unset" : "set");
  add("--no-shuffle", o.shuffle ? "off" : "on");
  add("--shuffle-order", o.shuffle_order);
  add("--drop-last", o.drop_last ? "on" : "off");
  add("--random-crop", o.random_crop ? std::to_string(*o.random_crop) : "unset");
  add("--random-flip", o.random_flip ? "on" : "off");
  add("--normalize", o.normalize);
  add("--skip-bad-images", o.skip_bad_images ? "on" : "off");
  add("--resize", o.resize);
  add("--no-eval", o.eval ? "off" : "on");
  add("--backend", o.backend);
  // Replicas on different kinds of device would round differently and drift apart.
  add("the training device (--device)", device.is_cuda() ? "cuda" : "cpu");
  add("--bucket-cap-mb", fmt::format("{}", o.bucket_cap_mb));
  add("--grad-compression", o.grad_compression);
  // A rank scaling its loss (or rounding its operands) differently would send gradients
  // of another size into the average.
  add("--amp", o.amp);
  add("--loss-scale", uses_loss_scaler(o) ? "dynamic" : "none");
  add("--initial-loss-scale", fmt::format("{}", o.initial_loss_scale));
  add("--loss-scale-growth-interval", std::to_string(o.loss_scale_growth_interval));
  add("--grad-accum", std::to_string(o.grad_accum));
  add("--check-replicas", std::to_string(o.check_replicas));
  add("--sync-bn", o.sync_bn ? "on" : "off");
  add("--timeout", fmt::format("{}", o.timeout_seconds));
  add("--lr-scaling", o.lr_scaling);
  add("--warmup-epochs", fmt::format("{}", o.warmup_epochs));
  add("--lr-schedule", o.lr_schedule);
  add("--checkpoint-every", std::to_string(o.checkpoint_every));
  add("--checkpoint-dir", o.checkpoint_dir.empty() ? "unset" : "set");
  // Rank 0 writes the file and every rank learns the outcome in a collective.
  add("--save-final", o.save_final.empty() ? "unset" : "set");
  // Tracing aligns the ranks' clocks with barriers; each rank may write to a directory of its own.
  add("--trace", o.trace_dir.empty() ? "unset" : "set");
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
      {"--shuffle-order", o.shuffle_order},
      {"--drop-last", o.drop_last ? "on" : "off"},
      {"--random-crop", o.random_crop ? std::to_string(*o.random_crop) : "unset"},
      {"--random-flip", o.random_flip ? "on" : "off"},
      {"--normalize", o.normalize},
      {"--resize", o.resize},
      {"--sync-bn", o.sync_bn ? "on" : "off"},
      {"--lr-scaling", o.lr_scaling},
      {"--warmup-epochs", fmt::format("{}", o.warmup_epochs)},
      {"--lr-schedule", o.lr_schedule},
      {"--amp", o.amp},
      {"--loss-scale", uses_loss_scaler(o) ? "dynamic" : "none"},
      {"--grad-compression", o.grad_compression},
  };
  // When the scale grows decides which later steps overflow and are skipped.
  if (uses_loss_scaler(o)) {
    items.emplace_back("--loss-scale-growth-interval", std::to_string(o.loss_scale_growth_interval));
  }
  if (o.lr_schedule != "constant") {
    items.emplace_back("--epochs", std::to_string(o.epochs));
    items.emplace_back("--max-steps", o.max_steps ? std::to_string(*o.max_steps) : "unset");
  }
  return items;
}

// Note [Which flags must agree]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A flag given to some ranks only either changes what is trained (the replicas drift
// apart) or the sequence of collectives (a rank waits in an operation its peers never
// start, until --timeout). Both kinds are compared at start-up. The flags below change
// neither and may differ from rank to rank; test_train_options checks that every flag
// is in exactly one of the two lists, so a new flag cannot be forgotten.
const std::vector<std::string>& per_rank_flags() {
  static const std::vector<std::string> flags = {
      "--data-dir",         // the training set's fingerprint is compared instead
      "--threads",          // host kernel threads
      "--log-level",        // rank 0 alone logs at info level
      "--log-every",        // progress lines and step events: rank 0, no collective
      "--progress-every",   // rank 0's progress output, no collective
      "--metrics",          // written by rank 0 alone
      "--plot",             // drawn by rank 0 alone
      "--trace-steps",      // what each rank records, no collective
      "--cudnn-benchmark",  // a GPU's own algorithm choice: the gradients are averaged
      "--deterministic",
      "--no-tf32",
      "--channels-last",    // the layout of a rank's own activations: float rounding alone
      "--unauthenticated-store",  // whether this rank accepts a store without a secret
  };
  return flags;
}

}  // namespace mtrain
