#include "trainer/options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cxxopts.hpp>
#include <filesystem>
#include <limits>
#include <utility>
#include <vector>

#include "core/env.h"
#include "data/data_source.h"
#include "data/random.h"
#include "collectives/process_group.h"
#include "core/error.h"
#include "trainer/checkpoint/checkpoint_file.h"
#include "trainer/ddp/share_policy.h"

namespace mtrain {

namespace {

constexpr const char* kLogLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
constexpr const char* kInitSchemes[] = {"default", "normal", "xavier"};

bool contains(const std::vector<std::string>& names, const std::string& name) {
  for (const auto& n : names) {
    if (n == name) return true;
  }
  return false;
}

// "auto" and every backend mtrain knows (collectives' registry): one not built in is
// refused later, when the group is made, with the reason.
std::vector<std::string> backend_choices() {
  std::vector<std::string> names{"auto"};
  for (const BackendInfo& b : known_backends()) names.push_back(b.name);
  return names;
}

std::string backend_help() {
  std::vector<std::string> names = backend_choices();
  names.front() = "auto (nccl on GPUs, mpi under mpirun, else gloo)";
  return fmt::format("collectives: {}", fmt::join(names, " | "));
}

void check_choice(const std::string& flag, const std::string& value,
                  const std::vector<std::string>& valid) {
  if (!contains(valid, value)) {
    throw InvalidArgument(fmt::format("{}: unknown value '{}' (valid: {})", flag, value,
                                      fmt::join(valid, ", ")));
  }
}

double parse_double(const std::string& text, const std::string& flag) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end == text.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) {
    throw InvalidArgument(fmt::format("{}: expected a finite number, found '{}'", flag, text));
  }
  return v;
}

// A switch (--sync-bn): cxxopts also takes --sync-bn=false, which must mean off, not on.
bool switch_on(const cxxopts::ParseResult& r, const char* name) { return r.count(name) != 0 && r[name].as<bool>(); }

// cxxopts takes --sync-bn=VALUE for a switch and reports a value it cannot read as
// "Argument 'yes' failed to parse", without the flag; this check comes first and names it.
void check_switch_values(const cxxopts::Options& spec, int argc, const char* const* argv) {
  std::vector<std::string> switches;
  for (const std::string& group : spec.groups()) {
    for (const auto& option : spec.group_help(group).options) {
      if (option.is_boolean) switches.insert(switches.end(), option.l.begin(), option.l.end());
    }
  }
  // What cxxopts reads: (t|T)(rue)?|1 and (f|F)(alse)?|0.
  static const char* const kValues[] = {"true", "True", "t", "T", "1", "false", "False", "f", "F", "0"};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos || !contains(switches, arg.substr(2, eq - 2))) continue;
    const std::string value = arg.substr(eq + 1);
    if (std::find(std::begin(kValues), std::end(kValues), value) == std::end(kValues)) {
      throw InvalidArgument(fmt::format("{}: a switch takes no value, or =true / =false (also 1, 0), found '{}'",
                                        arg.substr(0, eq), value));
    }
  }
}

// Numbers are taken as strings and parsed here so every bad value gets the same
// "flag: expected ..., found ..." message (cxxopts' own conversion errors do not
// say which flag or what range).
template <class T>
void read_int(const cxxopts::ParseResult& r, const char* name, T& out, int64_t min, int64_t max) {
  if (r.count(name) != 0) {
    out = static_cast<T>(env::parse_int(r[name].as<std::string>(), fmt::format("--{}", name), min, max));
  }
}

const ModelRecipe* recipe_for(const std::string& model) {
  for (const ModelRecipe& recipe : model_recipes()) {
    if (recipe.model == model) return &recipe;
  }
  return nullptr;  // an unknown model: validation names it
}

// Note [Each model's recipe]: the recipe first, the flags given then override it.
void apply_model_recipe(TrainOptions& o) {
  const ModelRecipe* recipe = recipe_for(o.model);
  if (recipe == nullptr) return;
  o.init = recipe->init;
  o.lr = recipe->lr;
  o.momentum = recipe->momentum;
  o.batch_size = recipe->batch_size;
  o.epochs = recipe->epochs;
}

// The values the recipe supplied, as flags, for the log ("--init xavier --lr 0.1 ...").
void describe_recipe(const cxxopts::ParseResult& r, TrainOptions& o) {
  if (recipe_for(o.model) == nullptr) return;
  std::vector<std::string> taken;
  const auto add = [&](const char* flag, const std::string& value) {
    if (r.count(flag) == 0) taken.push_back(fmt::format("--{} {}", flag, value));
  };
  if (o.init_from.empty()) add("init", o.init);
  add("epochs", std::to_string(o.epochs));
  if (!o.global_batch_size) add("batch-size", std::to_string(o.batch_size));
  add("lr", fmt::format("{}", o.lr));
  add("momentum", fmt::format("{}", o.momentum));
  o.recipe = fmt::format("{}", fmt::join(taken, " "));
}

// "FIRST:LAST", 1 <= FIRST <= LAST.
void read_step_range(const std::string& text, const char* flag, int64_t& first, int64_t& last) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    throw InvalidArgument(fmt::format("{}: expected FIRST:LAST (optimizer steps, e.g. 11:30), found '{}'", flag, text));
  }
  first = env::parse_int(text.substr(0, colon), fmt::format("{}'s FIRST", flag), 1, std::numeric_limits<int64_t>::max());
  last = env::parse_int(text.substr(colon + 1), fmt::format("{}'s LAST", flag), 1, std::numeric_limits<int64_t>::max());
  if (last < first) throw InvalidArgument(fmt::format("{}: expected FIRST <= LAST, found {}", flag, text));
}

void read_double(const cxxopts::ParseResult& r, const char* name, double& out) {
  if (r.count(name) != 0) out = parse_double(r[name].as<std::string>(), fmt::format("--{}", name));
}

void read_path(const cxxopts::ParseResult& r, const char* name, std::string& out) {
  if (r.count(name) == 0) return;
  out = r[name].as<std::string>();
  if (out.empty()) throw InvalidArgument(fmt::format("--{}: expected a path, found an empty string", name));
}

// The files a run reads and writes, compared as the paths they resolve to (so that
// `runs/a/./w.safetensors` is `runs/a/w.safetensors`): two of them naming one file would
// have one output replace the other, or the final weights the ones the run started from.
// (Writing --save-final over --init-from would be safe for the file, the write is
// atomic, but is almost always a typo.)
void check_distinct_files(const TrainOptions& o) {
  std::vector<std::pair<std::string, std::string>> files;  // flag, path
  if (!o.init_from.empty()) files.emplace_back("--init-from", o.init_from);
  if (!o.save_final.empty()) files.emplace_back("--save-final", o.save_final);
  if (!o.metrics.empty()) files.emplace_back("--metrics", o.metrics);
  if (!o.plot.empty()) files.emplace_back("--plot", o.plot);
  if (!o.checkpoint_dir.empty()) files.emplace_back("--checkpoint-dir's checkpoint", checkpoint_path(o.checkpoint_dir));
  const auto resolved = [](const std::string& path) {
    std::error_code ec;
    std::filesystem::path p = std::filesystem::absolute(path, ec);
    if (!ec) p = std::filesystem::weakly_canonical(p, ec);
    return (ec ? std::filesystem::path(path) : p).lexically_normal();
  };
  for (size_t i = 0; i < files.size(); ++i) {
    for (size_t j = i + 1; j < files.size(); ++j) {
      if (resolved(files[i].second) == resolved(files[j].second)) {
        throw InvalidArgument(fmt::format("{} {} is the same file as {} {}; choose another path", files[j].first,
                                          files[j].second, files[i].first, files[i].second));
      }
    }
  }
}

}  // namespace

Normalization parse_normalize(const std::string& value) {
  Normalization n;
  if (value == "none") return n;
  if (value == "auto") {
    n.automatic = true;
    return n;
  }
  const size_t colon = value.find(':');
  const auto numbers = [&](const std::string& part, const char* what) {
    std::vector<float> out;
    size_t start = 0;
    while (start <= part.size()) {
      const size_t comma = std::min(part.find(',', start), part.size());
      out.push_back(static_cast<float>(parse_double(part.substr(start, comma - start),
                                                    fmt::format("--normalize's {}", what))));
      start = comma + 1;
    }
    return out;
  };
  if (colon == std::string::npos) {
    throw InvalidArgument(fmt::format(
        "--normalize: expected none, auto or MEANS:STDS (e.g. 0.49,0.48,0.45:0.25,0.24,0.26), found '{}'", value));
  }
  n.mean = numbers(value.substr(0, colon), "mean");
  n.std = numbers(value.substr(colon + 1), "std");
  if (n.mean.size() != n.std.size()) {
    throw InvalidArgument(fmt::format("--normalize: expected as many means as stds, found {} and {} in '{}'",
                                      n.mean.size(), n.std.size(), value));
  }
  for (float s : n.std) {
    if (!(s > 0.0f) || !std::isfinite(s)) {
      throw InvalidArgument(fmt::format("--normalize: expected every std > 0, found {} in '{}'", s, value));
    }
  }
  return n;
}

ImageSize parse_resize(const std::string& value) {
  if (value == "off") return {};
  const size_t x = value.find('x');
  constexpr int64_t kMaxSide = 65536;
  const std::string height = value.substr(0, x);
  const std::string width = x == std::string::npos ? height : value.substr(x + 1);
  if (height.empty() || width.empty()) {
    throw InvalidArgument(
        fmt::format("--resize: expected off, HEIGHTxWIDTH or SIZE (e.g. 32x32 or 32), found '{}'", value));
  }
  return {env::parse_int(height, "--resize's height", 1, kMaxSide), env::parse_int(width, "--resize's width", 1, kMaxSide)};
}

data::ImageFolderOptions image_folder_options(const TrainOptions& o) {
  const ImageSize size = parse_resize(o.resize);
  return {.skip_bad_files = o.skip_bad_images, .height = size.height, .width = size.width};
}

int64_t items_per_step(const TrainOptions& o, int world_size) {
  return o.global_batch_size ? *o.global_batch_size : o.batch_size * o.grad_accum * world_size;
}

void validate_train_options(const TrainOptions& o, const TrainChoices& choices) {
  check_choice("--model", o.model, choices.models);
  check_choice("--dataset", o.dataset, choices.datasets);
  check_choice("--init", o.init, {std::begin(kInitSchemes), std::end(kInitSchemes)});
  data::parse_permutation(o.shuffle_order);  // the one place that knows the names
  parse_normalize(o.normalize);
  data::require_folder_options_apply(o.dataset, image_folder_options(o));
  check_choice("--log-level", o.log_level, {std::begin(kLogLevels), std::end(kLogLevels)});
  if (o.epochs < 1) throw InvalidArgument(fmt::format("--epochs: expected an integer >= 1, found {}", o.epochs));
  if (o.max_steps && *o.max_steps < 0) {
    throw InvalidArgument(fmt::format("--max-steps: expected an integer >= 0, found {}", *o.max_steps));
  }
  if (o.batch_size < 1) {
    throw InvalidArgument(fmt::format("--batch-size: expected an integer >= 1, found {}", o.batch_size));
  }
  // The optimizer works in float32: a larger value would become infinity there.
  constexpr double kFloatMax = std::numeric_limits<float>::max();
  if (!(std::isfinite(o.lr) && o.lr > 0 && o.lr <= kFloatMax)) {
    throw InvalidArgument(fmt::format("--lr: expected a number > 0 and at most {:g} (float32's largest), found {}",
                                      kFloatMax, o.lr));
  }
  if (!(std::isfinite(o.momentum) && o.momentum >= 0 && o.momentum < 1)) {
    throw InvalidArgument(fmt::format("--momentum: expected a number in [0, 1), found {}", o.momentum));
  }
  if (!(std::isfinite(o.weight_decay) && o.weight_decay >= 0 && o.weight_decay <= kFloatMax)) {
    throw InvalidArgument(fmt::format("--weight-decay: expected a number >= 0 and at most {:g}, found {}", kFloatMax,
                                      o.weight_decay));
  }
  if (o.nesterov && o.momentum == 0) {
    throw InvalidArgument("--nesterov needs a momentum > 0 (as torch.optim.SGD); add --momentum 0.9");
  }
  if (o.threads && *o.threads < 1) {
    throw InvalidArgument(fmt::format("--threads: expected an integer >= 1, found {}", *o.threads));
  }
  if (!(o.progress_every > 0 && o.progress_every <= 1e6)) {
    throw InvalidArgument(
        fmt::format("--progress-every: expected a number of seconds > 0 and at most 1e6, found {}", o.progress_every));
  }
  if (o.log_every < 1) {
    throw InvalidArgument(fmt::format("--log-every: expected an integer >= 1, found {}", o.log_every));
  }
  check_choice("--backend", o.backend, backend_choices());
  check_choice("--device", o.device, {"auto", "cuda", "cpu"});
  if (o.device == "cpu" && o.backend != "auto" && backend_info(o.backend).device_tensors_only) {
    throw InvalidArgument(fmt::format(
        "--backend {} needs GPUs, but --device cpu trains on the CPU: use --backend gloo or mpi", o.backend));
  }
  check_choice("--amp", o.amp, {"off", "bf16", "fp16"});
  check_choice("--grad-compression", o.grad_compression, {"none", "bf16", "fp16"});
  check_choice("--loss-scale", o.loss_scale, {"auto", "dynamic", "none"});
  // A normal float32 whose reciprocal is finite (both multiply gradients in float32).
  if (!(o.initial_loss_scale >= std::numeric_limits<float>::min() &&
        o.initial_loss_scale <= std::numeric_limits<float>::max())) {
    throw InvalidArgument(fmt::format(
        "--initial-loss-scale: expected a number from 1.2e-38 to 3.4e38 (a normal float32), found {}",
        o.initial_loss_scale));
  }
  if (o.loss_scale_growth_interval < 1) {
    throw InvalidArgument(fmt::format("--loss-scale-growth-interval: expected an integer >= 1, found {}",
                                      o.loss_scale_growth_interval));
  }
  check_choice("--lr-scaling", o.lr_scaling, {"none", "linear"});
  check_choice("--lr-schedule", o.lr_schedule, {"constant", "step", "cosine"});
  // The cap becomes a byte count (size_t): bounded so that the conversion is defined.
  if (!(std::isfinite(o.bucket_cap_mb) && o.bucket_cap_mb > 0 && o.bucket_cap_mb <= 1e6)) {
    throw InvalidArgument(fmt::format("--bucket-cap-mb: expected a number > 0 and at most 1e6, found {}",
                                      o.bucket_cap_mb));
  }
  if (o.grad_accum < 1) {
    throw InvalidArgument(fmt::format("--grad-accum: expected an integer >= 1, found {}", o.grad_accum));
  }
  if (o.check_replicas < 0) {
    throw InvalidArgument(fmt::format("--check-replicas: expected an integer >= 0, found {}", o.check_replicas));
  }
  if (o.global_batch_size && *o.global_batch_size < 1) {
    throw InvalidArgument(fmt::format("--global-batch-size: expected an integer >= 1, found {}", *o.global_batch_size));
  }
  if (o.global_batch_size && o.lr_scaling == "linear") {
    throw InvalidArgument(
        "--lr-scaling linear multiplies --lr by the world size because a per-rank --batch-size grows the global "
        "batch with it; --global-batch-size fixes the global batch, so there is nothing to scale (give --lr for "
        "that batch)");
  }
  if (parse_balance(o.balance).kind != BalanceSpec::Kind::kEven && !o.global_batch_size) {
    throw InvalidArgument(fmt::format(
        "--balance {} splits a global batch between the ranks: give --global-batch-size G (with --batch-size every "
        "rank takes the same number of images)",
        o.balance));
  }
  if (o.global_batch_size && o.grad_accum > 1) {
    // The sample weighting is per micro-batch (Note [Reducer gradient weighting]);
    // accumulated micro-batches of different sizes would need per-micro-batch weights.
    throw InvalidArgument("--global-batch-size cannot be combined with --grad-accum > 1 (use --batch-size)");
  }
  // Whole milliseconds, added to clock readings: from 1 ms to about 115 days.
  if (!(std::isfinite(o.timeout_seconds) && o.timeout_seconds >= 0.001 && o.timeout_seconds <= 1e7)) {
    throw InvalidArgument(fmt::format("--timeout: expected a number of seconds from 0.001 to 1e7, found {}",
                                      o.timeout_seconds));
  }
  if (!(std::isfinite(o.warmup_epochs) && o.warmup_epochs >= 0)) {
    throw InvalidArgument(fmt::format("--warmup-epochs: expected a number >= 0, found {}", o.warmup_epochs));
  }
  if (o.checkpoint_every < 0) {
    throw InvalidArgument(fmt::format("--checkpoint-every: expected an integer >= 0, found {}", o.checkpoint_every));
  }
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty()) {
    throw InvalidArgument(fmt::format("--checkpoint-every {} needs --checkpoint-dir DIR to write to",
                                      o.checkpoint_every));
  }
  check_distinct_files(o);
}

// Note [Each model's recipe]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// One set of hyperparameters cannot serve four models: at mlp's batch 256 and lr 0.1, d2l's
// sigmoid LeNet sits on its initial plateau (loss 2.30) for the 240 steps of 10 epochs on the
// shipped 6,000 images, and SimpleCNN, whose global pooling comes straight after two
// convolutions, is still near 0.35 (docs/benchmarks.md, "Each model's recipe"). So the flags a
// recipe covers take, when the command line leaves them out, the chosen model's values below:
// each reaches a sensible accuracy on the shipped set at its defaults (docs/training.md lists what
// each reaches, tests/trainer/runs/test_model_recipes.cpp checks that each learns). A flag given
// always wins, and the log names the values the recipe supplied.
const std::vector<ModelRecipe>& model_recipes() {
  static const std::vector<ModelRecipe> recipes = {
      {"mlp", "default", 0.1, 0.9, 256, 10},
      {"lenet", "xavier", 0.1, 0.9, 64, 30},
      {"simplecnn", "default", 0.2, 0.9, 32, 10},
      {"resnet18", "default", 0.1, 0.9, 256, 10},
  };
  return recipes;
}

namespace {

cxxopts::Options train_command_spec(const TrainChoices& choices) {
  const TrainOptions d;  // defaults, shown in --help
  cxxopts::Options spec("mtrain-train", "Train an image classifier with data-parallel SGD (one replica per process; see docs/training.md).");
  spec.set_width(100);
  // clang-format off
  spec.add_options("Model and data")
    ("model", fmt::format("model: {}", fmt::join(choices.models, "|")), cxxopts::value<std::string>()->default_value(d.model))
    ("dataset", fmt::format("dataset: {}", fmt::join(choices.datasets, "|")), cxxopts::value<std::string>()->default_value(d.dataset))
    ("data-dir", "directory with the IDX files (default: data/<dataset> if it holds the full set, else the shipped mini set)", cxxopts::value<std::string>())
    ("init", "initialisation: default (PyTorch's) | normal (N(0, 0.01) conv/linear weights, as d2l) | xavier (nn.init.xavier_uniform_ conv/linear weights, d2l's LeNet recipe); default: the model's recipe", cxxopts::value<std::string>())
    ("init-from", "start from the weights in this safetensors file", cxxopts::value<std::string>())
    ("seed", "seed for initialisation, shuffling and synthetic data", cxxopts::value<std::string>()->default_value(std::to_string(d.seed)));
  spec.add_options("Training")
    ("epochs", "passes over the training set (default: the model's recipe)", cxxopts::value<std::string>())
    ("max-steps", "stop after this many optimizer steps in total (default: no limit; 0 trains nothing, so --save-final writes the initial weights)", cxxopts::value<std::string>())
    ("batch-size", "images per rank per micro-batch (x world size x --grad-accum per optimizer step; default: the model's recipe)", cxxopts::value<std::string>())
    ("lr", "learning rate (default: the model's recipe)", cxxopts::value<std::string>())
    ("momentum", "SGD momentum, in [0, 1) (default: the model's recipe)", cxxopts::value<std::string>())
    ("weight-decay", "L2 penalty added to the gradient (torch.optim.SGD weight_decay)", cxxopts::value<std::string>()->default_value(fmt::format("{}", d.weight_decay)))
    ("nesterov", "Nesterov momentum")
    ("no-shuffle", "read the training set in file order (to compare runs with other frameworks)")
    ("shuffle-order", "the shuffled order: mtrain (its own generator) | torch (torch.randperm's for a generator seeded --seed + epoch, as PyTorch's DistributedSampler draws it)", cxxopts::value<std::string>()->default_value(d.shuffle_order))
    ("random-crop", "training images: torchvision's RandomCrop(size, padding=PAD), the image's own size after PAD zero pixels on every side (CIFAR recipes use 4)", cxxopts::value<std::string>())
    ("random-flip", "training images: torchvision's RandomHorizontalFlip() (mirrored with probability 1/2)")
    ("normalize", "pixels/255 then (x - mean) / std per channel: none | auto (the training set's mean and std, computed once) | M1,M2,M3:S1,S2,S3 (one value each, or one per channel)", cxxopts::value<std::string>()->default_value(d.normalize))
    ("skip-bad-images", "--dataset imagefolder: leave out (and count in the log) files that are not images or do not decode, instead of stopping")
    ("resize", "--dataset imagefolder: every image resampled to HxW as it is decoded (torchvision's Resize((H, W)) on a PIL image, bilinear); N means NxN; off keeps each image's size, which must then be one", cxxopts::value<std::string>()->default_value(d.resize))
    ("drop-last", "the training sampler drops the last N mod world-size images instead of repeating some (DistributedSampler's drop_last); with --global-batch-size, the last partial global batch")
    ("threads", "intra-op threads (default: OMP_NUM_THREADS if set, else 1 per rank when several ranks share the node, else every core)", cxxopts::value<std::string>());
  spec.add_options("Device")
    ("device", "where each replica trains: auto (its GPU when one is usable, else the CPU) | cuda | cpu", cxxopts::value<std::string>()->default_value(d.device))
    ("cudnn-benchmark", "GPU: time cuDNN's convolution algorithms for each new shape and keep the fastest (torch.backends.cudnn.benchmark)")
    ("deterministic", "GPU: only convolution algorithms cuDNN documents as deterministic (torch.backends.cudnn.deterministic)")
    ("no-tf32", "GPU: full float32 convolutions, no TF32 tensor cores (matrix products never use TF32)")
    ("channels-last", "keep activations [N, H, W, C] in memory (PyTorch's channels_last), the layout cuDNN's tensor-core convolutions take natively; on the CPU only slower")
    ("amp", "mixed precision: off | bf16 | fp16 (convolutions and linear layers multiply in 16 bits, everything else stays float32; bf16 needs a GPU of compute capability 8.0+ or an AVX-512 CPU, at full speed with AVX512_BF16; fp16 a GPU of 7.0+ or a CPU with AVX512_FP16)", cxxopts::value<std::string>()->default_value(d.amp))
    ("loss-scale", "auto (dynamic with --amp fp16, else none) | dynamic (scale the loss, skip steps whose gradients overflow, as GradScaler) | none", cxxopts::value<std::string>()->default_value(d.loss_scale))
    ("initial-loss-scale", "the dynamic loss scale's starting value", cxxopts::value<std::string>()->default_value(fmt::format("{}", d.initial_loss_scale)))
    ("loss-scale-growth-interval", "steps with finite gradients after which the dynamic loss scale doubles", cxxopts::value<std::string>()->default_value(std::to_string(d.loss_scale_growth_interval)));
  spec.add_options("Distributed")
    ("backend", backend_help(), cxxopts::value<std::string>()->default_value(d.backend))
    ("bucket-cap-mb", "gradient bucket size cap in MiB (the first bucket is 1 MiB)", cxxopts::value<std::string>()->default_value(fmt::format("{}", d.bucket_cap_mb)))
    ("grad-compression", "none | bf16 | fp16: all-reduce the gradient buckets in 16 bits (DDP's bf16/fp16 compress hooks)", cxxopts::value<std::string>()->default_value(d.grad_compression))
    ("grad-accum", "micro-batches per optimizer step; gradients are exchanged on the last only", cxxopts::value<std::string>()->default_value(std::to_string(d.grad_accum)))
    ("check-replicas", "every N optimizer steps verify that every rank holds the same parameters (0 = never)", cxxopts::value<std::string>()->default_value(std::to_string(d.check_replicas)))
    ("sync-bn", "convert every BatchNorm2d to SyncBatchNorm (statistics over the global batch)")
    ("global-batch-size", "images per optimizer step over all ranks, split like torch.chunk (instead of --batch-size per rank)", cxxopts::value<std::string>())
    ("balance", "with --global-batch-size: even (torch.chunk's split) | auto (split by each rank's measured speed) | static:N0,N1,... (one share per rank, summing to the global batch)", cxxopts::value<std::string>()->default_value(d.balance))
    ("timeout", "seconds any collective may take before the run fails", cxxopts::value<std::string>()->default_value(fmt::format("{}", d.timeout_seconds)))
    ("unauthenticated-store", "workers started without mtrain-launch, MPI or MTRAIN_STORE_TOKEN: let rank 0 host the rendezvous store without a secret on an address other hosts can reach, where anyone who reaches it can join or disrupt the job")
    ("lr-scaling", "none | linear (lr x world size)", cxxopts::value<std::string>()->default_value(d.lr_scaling))
    ("warmup-epochs", "linear warm-up from --lr to the scaled rate over this many epochs", cxxopts::value<std::string>()->default_value(fmt::format("{}", d.warmup_epochs)))
    ("lr-schedule", "constant | step (x0.1 at 50% and 75%) | cosine", cxxopts::value<std::string>()->default_value(d.lr_schedule));
  spec.add_options("Output")
    ("save-final", "write every parameter and buffer to this safetensors file at the end", cxxopts::value<std::string>())
    ("checkpoint-dir", "keep checkpoints (model, momentum, position) in DIR: the latest, DIR/checkpoint.safetensors, and the one before, DIR/checkpoint.previous.safetensors; resume from the latest that passes its checks", cxxopts::value<std::string>())
    ("checkpoint-every", "also checkpoint every N optimizer steps (checkpoints are always written at the end of each epoch and when a stop signal arrives)", cxxopts::value<std::string>()->default_value(std::to_string(d.checkpoint_every)))
    ("metrics", "write JSON lines (one object per logged step and per epoch) to this file", cxxopts::value<std::string>())
    ("plot", "draw the training curves (train loss, train and test accuracy per epoch, as d2l) to this .png or .svg file, redrawn after every epoch", cxxopts::value<std::string>())
    ("no-eval", "skip the test-set evaluation at the end of each epoch")
    ("log-level", "trace|debug|info|warn|error|critical|off", cxxopts::value<std::string>()->default_value(d.log_level))
    ("log-every", "optimizer steps between progress lines", cxxopts::value<std::string>()->default_value(std::to_string(d.log_every)))
    ("trace", "write a timeline (Chrome trace events: forward, backward, each bucket's all-reduce, SyncBatchNorm, data, optimizer, evaluation, checkpoints) to DIR/rank-R.json per rank, merged into DIR/trace.json for Perfetto or chrome://tracing", cxxopts::value<std::string>())
    ("trace-steps", "the optimizer steps --trace records, FIRST:LAST (evaluations and checkpoints are always recorded)", cxxopts::value<std::string>()->default_value(fmt::format("{}:{}", d.trace_first_step, d.trace_last_step)))
    ("progress-every", "in a log file or under a scheduler: a progress line (training or evaluation) whenever this many seconds passed without one; on a terminal a bar redraws in place instead", cxxopts::value<std::string>()->default_value(fmt::format("{}", d.progress_every)))
    ("h,help", "print this help");
  // clang-format on
  return spec;
}

}  // namespace

std::vector<std::string> train_flag_names() {
  const cxxopts::Options spec = train_command_spec(TrainChoices{});
  std::vector<std::string> names;
  for (const std::string& group : spec.groups()) {
    for (const auto& option : spec.group_help(group).options) {
      for (const std::string& name : option.l) {
        if (name != "help") names.push_back("--" + name);
      }
    }
  }
  return names;
}

ParsedTrainCommandLine parse_train_command_line(int argc, const char* const* argv,
                                                const TrainChoices& choices) {
  cxxopts::Options spec = train_command_spec(choices);
  check_switch_values(spec, argc, argv);
  cxxopts::ParseResult r;
  try {
    r = spec.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    throw InvalidArgument(fmt::format("{} (see --help)", e.what()));
  }
  ParsedTrainCommandLine out;
  if (r.count("help") != 0) {
    out.help = true;
    out.help_text = spec.help();
    return out;
  }
  if (!r.unmatched().empty()) {
    throw InvalidArgument(fmt::format("unexpected argument '{}' (flags start with --; see --help)",
                                      r.unmatched().front()));
  }

  TrainOptions& o = out.options;
  o.model = r["model"].as<std::string>();
  o.dataset = r["dataset"].as<std::string>();
  read_path(r, "data-dir", o.data_dir);
  apply_model_recipe(o);
  if (r.count("init") != 0) o.init = r["init"].as<std::string>();
  read_path(r, "init-from", o.init_from);
  o.seed = static_cast<uint64_t>(
      env::parse_int(r["seed"].as<std::string>(), "--seed", 0, std::numeric_limits<int64_t>::max()));
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  read_int(r, "epochs", o.epochs, 1, 1'000'000);
  if (r.count("max-steps") != 0) {
    o.max_steps = env::parse_int(r["max-steps"].as<std::string>(), "--max-steps", 0, kMax);
  }
  read_int(r, "batch-size", o.batch_size, 1, 1'000'000);
  read_double(r, "lr", o.lr);
  read_double(r, "momentum", o.momentum);
  read_double(r, "weight-decay", o.weight_decay);
  o.nesterov = switch_on(r, "nesterov");
  o.shuffle = !switch_on(r, "no-shuffle");
  o.shuffle_order = r["shuffle-order"].as<std::string>();
  o.drop_last = switch_on(r, "drop-last");
  if (r.count("random-crop") != 0) o.random_crop = env::parse_int(r["random-crop"].as<std::string>(), "--random-crop", 0, 4096);
  o.random_flip = switch_on(r, "random-flip");
  o.skip_bad_images = switch_on(r, "skip-bad-images");
  o.resize = r["resize"].as<std::string>();
  o.normalize = r["normalize"].as<std::string>();
  if (r.count("threads") != 0) {
    int threads = 0;
    read_int(r, "threads", threads, 1, 4096);
    o.threads = threads;
  }
  read_path(r, "save-final", o.save_final);
  read_path(r, "metrics", o.metrics);
  read_path(r, "plot", o.plot);
  read_path(r, "checkpoint-dir", o.checkpoint_dir);
  read_int(r, "checkpoint-every", o.checkpoint_every, 0, kMax);
  o.eval = !switch_on(r, "no-eval");
  o.log_level = r["log-level"].as<std::string>();
  read_double(r, "progress-every", o.progress_every);
  read_path(r, "trace", o.trace_dir);
  read_step_range(r["trace-steps"].as<std::string>(), "--trace-steps", o.trace_first_step, o.trace_last_step);
  read_int(r, "log-every", o.log_every, 1, kMax);

  o.device = r["device"].as<std::string>();
  o.cudnn_benchmark = switch_on(r, "cudnn-benchmark");
  o.deterministic = switch_on(r, "deterministic");
  o.allow_tf32 = !switch_on(r, "no-tf32");
  o.channels_last = switch_on(r, "channels-last");
  o.amp = r["amp"].as<std::string>();
  o.loss_scale = r["loss-scale"].as<std::string>();
  read_double(r, "initial-loss-scale", o.initial_loss_scale);
  read_int(r, "loss-scale-growth-interval", o.loss_scale_growth_interval, 1, kMax);

  o.backend = r["backend"].as<std::string>();
  read_double(r, "bucket-cap-mb", o.bucket_cap_mb);
  o.grad_compression = r["grad-compression"].as<std::string>();
  read_int(r, "grad-accum", o.grad_accum, 1, 1'000'000);
  read_int(r, "check-replicas", o.check_replicas, 0, kMax);
  o.sync_bn = switch_on(r, "sync-bn");
  if (r.count("global-batch-size") != 0) {
    if (r.count("batch-size") != 0) {
      throw InvalidArgument(fmt::format(
          "--batch-size {} and --global-batch-size {}: give one; --batch-size is per rank, --global-batch-size "
          "is split across the ranks",
          r["batch-size"].as<std::string>(), r["global-batch-size"].as<std::string>()));
    }
    o.global_batch_size = env::parse_int(r["global-batch-size"].as<std::string>(), "--global-batch-size", 1, 1'000'000);
  }
  o.balance = r["balance"].as<std::string>();
  read_double(r, "timeout", o.timeout_seconds);
  o.unauthenticated_store = switch_on(r, "unauthenticated-store");
  o.lr_scaling = r["lr-scaling"].as<std::string>();
  read_double(r, "warmup-epochs", o.warmup_epochs);
  o.lr_schedule = r["lr-schedule"].as<std::string>();

  describe_recipe(r, o);
  validate_train_options(o, choices);
  return out;
}

bool uses_loss_scaler(const TrainOptions& o) {
  return o.loss_scale == "dynamic" || (o.loss_scale == "auto" && o.amp == "fp16");
}

}  // namespace mtrain
