#include "trainer/options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cxxopts.hpp>
#include <filesystem>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/env.h"
#include "data/data_source.h"
#include "data/random.h"
#include "collectives/process_group.h"
#include "core/error.h"
#include "models/zoo.h"
#include "trainer/checkpoint/checkpoint_file.h"
#include "trainer/ddp/share_policy.h"

namespace mtrain {

namespace {

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

// One of `names`, each standing for a value.
template <class T>
std::function<T(const std::string&, const std::string&)> one_of(std::vector<std::pair<std::string, T>> names) {
  return [names = std::move(names)](const std::string& text, const std::string& flag) {
    std::vector<std::string> valid;
    for (const auto& [name, value] : names) {
      if (name == text) return value;
      valid.push_back(name);
    }
    check_choice(flag, text, valid);  // throws: `text` is none of them
    throw InternalError(fmt::format("{}: '{}' passed the choice check", flag, text));
  };
}

// --init's names, for the flag and the models' recipes.
models::InitScheme init_scheme(const std::string& text, const std::string& flag) {
  static const auto parse = one_of<models::InitScheme>({{"default", models::InitScheme::kPyTorchDefault},
                                                        {"normal", models::InitScheme::kNormal},
                                                        {"xavier", models::InitScheme::kXavier}});
  return parse(text, flag);
}

// --backend: auto, or a backend of the registry, built into this build or not (one that is not
// is refused when its group is made, with the reason).
BackendChoice backend_choice(const std::string& text, const std::string& flag) {
  check_choice(flag, text, backend_choices());
  return text == "auto" ? BackendChoice{} : BackendChoice{&backend_info(text)};
}

spdlog::level::level_enum log_level(const std::string& text, const std::string& flag) {
  using namespace spdlog::level;
  static const auto parse = one_of<level_enum>(
      {{"trace", trace}, {"debug", debug}, {"info", info}, {"warn", warn}, {"error", err}, {"critical", critical}, {"off", off}});
  return parse(text, flag);
}

const ModelRecipe* recipe_for(const std::string& model) {
  for (const ModelRecipe& recipe : model_recipes()) {
    if (recipe.model == model) return &recipe;
  }
  return nullptr;  // an unknown model: validation names it
}

// Note [Each model's recipe]: the recipe first, the flags given then override it.
void apply_model_recipe(TrainOptions& o) {
  if (models::is_onnx_file(o.model)) o.init = {"graph", models::InitScheme::kGraph};  // its initializers
  const ModelRecipe* recipe = recipe_for(o.model);
  if (recipe == nullptr) return;
  o.init = {recipe->init, init_scheme(recipe->init, "the recipe's --init")};
  o.lr = recipe->lr;
  o.momentum = recipe->momentum;
  o.batch_size = recipe->batch_size;
  o.epochs = recipe->epochs;
}

// "FIRST:LAST", 1 <= FIRST <= LAST.
void read_step_range(const std::string& text, const std::string& flag, int64_t& first, int64_t& last) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    throw InvalidArgument(fmt::format("{}: expected FIRST:LAST (optimizer steps, e.g. 11:30), found '{}'", flag, text));
  }
  first = env::parse_int(text.substr(0, colon), fmt::format("{}'s FIRST", flag), 1, std::numeric_limits<int64_t>::max());
  last = env::parse_int(text.substr(colon + 1), fmt::format("{}'s LAST", flag), 1, std::numeric_limits<int64_t>::max());
  if (last < first) throw InvalidArgument(fmt::format("{}: expected FIRST <= LAST, found {}", flag, text));
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

data::ImageShape parse_image_shape(const std::string& value) {
  const size_t a = value.find('x'), b = a == std::string::npos ? a : value.find('x', a + 1);
  if (b == std::string::npos) {
    throw InvalidArgument(fmt::format("--synthetic-shape: expected CxHxW (e.g. 3x224x224), found '{}'", value));
  }
  const data::ImageShape shape{env::parse_int(value.substr(0, a), "--synthetic-shape's channels", 1, 3),
                               env::parse_int(value.substr(a + 1, b - a - 1), "--synthetic-shape's height", 8, 4096),
                               env::parse_int(value.substr(b + 1), "--synthetic-shape's width", 8, 4096)};
  if (shape.channels == 2) throw InvalidArgument("--synthetic-shape: expected 1 or 3 channels, found 2");
  return shape;
}

data::SyntheticOptions synthetic_options(const TrainOptions& o) {
  data::SyntheticOptions s;
  s.seed = o.seed;
  s.shape = o.synthetic_shape.value;
  constexpr int64_t kMaxBytes = int64_t{256} << 20;
  s.train_size = std::clamp<int64_t>(kMaxBytes / s.shape.numel(), 16, s.train_size);
  s.test_size = std::max<int64_t>(s.train_size / 6, 4);
  return s;
}

data::ImageFolderOptions image_folder_options(const TrainOptions& o) {
  return {.skip_bad_files = o.skip_bad_images, .height = o.resize.value.height, .width = o.resize.value.width};
}

// Note [Streamed images' transforms]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// WebDataset shards are always streamed, an image folder when a crop is asked for (its
// images are then read and decoded per batch, as torchvision's ImageFolder does, instead of
// once into memory). Streamed images come in any size, so each split needs a transform that
// ends at one size, as an ImageNet recipe's torchvision transforms do:
// - training: --random-resized-crop N (RandomResizedCrop(N)); else --center-crop C
//   (Resize(S), CenterCrop(C)); else --resize HxW (Resize((H, W))).
// - evaluation: --center-crop C; else --resize HxW; else, after --random-resized-crop N
//   alone, Resize(S), CenterCrop(N).
// S, the shorter side before a centre crop, is --resize's one number when given, else C * 8 / 7
// (256 for 224: the reference recipes' crop ratio 0.875). Both splits must end at one size.
data::StreamedSplitsOptions streamed_options(const TrainOptions& o) {
  using data::ImageTransform;
  if (o.dataset != "webdataset" && !(o.dataset == "imagefolder" && (o.random_resized_crop || o.center_crop))) return {};
  const bool one_number = o.resize.value.height > 0 && o.resize.text.find('x') == std::string::npos;
  const auto centre = [&](int64_t c) {
    if (o.resize.value.height > 0 && !one_number) {
      throw InvalidArgument(fmt::format("--resize {} with a centre crop: the crop follows torchvision's Resize(S) of "
                                        "the shorter side, so give --resize as one number (e.g. --resize 256)",
                                        o.resize.text));
    }
    return ImageTransform{ImageTransform::Kind::kCenterCrop, c, c, one_number ? o.resize.value.height : c * 8 / 7, 0};
  };
  const ImageTransform squash{ImageTransform::Kind::kResize, o.resize.value.height, o.resize.value.width, 0, 0};
  data::StreamedSplitsOptions w;
  if (o.random_resized_crop) {
    w.train = {ImageTransform::Kind::kRandomResizedCrop, *o.random_resized_crop, *o.random_resized_crop, 0, o.seed};
  } else if (o.center_crop) {
    w.train = centre(*o.center_crop);
  } else if (o.resize.value.height > 0) {
    w.train = squash;
  } else {
    throw InvalidArgument("--dataset webdataset: its images come in any size; give the training images' transform: "
                          "--random-resized-crop N, --center-crop N (after --resize S), or --resize HxW");
  }
  if (o.center_crop) {
    w.eval = centre(*o.center_crop);
  } else if (o.resize.value.height > 0) {
    w.eval = squash;
  } else {
    w.eval = centre(*o.random_resized_crop);
  }
  if (w.eval.height != w.train.height || w.eval.width != w.train.width) {
    throw InvalidArgument(fmt::format("--dataset webdataset: the training images would be {}x{} ({}) but the "
                                      "evaluation images {}x{} ({}); give sizes that agree",
                                      w.train.height, w.train.width, w.train.describe(), w.eval.height, w.eval.width,
                                      w.eval.describe()));
  }
  w.train.reduced_decode = w.eval.reduced_decode = !o.full_decode;
  w.val_data = o.val_data;
  w.evaluate = o.eval;
  w.skip_bad = o.skip_bad_images;
  return w;
}

int64_t items_per_step(const TrainOptions& o, int world_size) {
  return o.global_batch_size ? *o.global_batch_size : o.batch_size * o.grad_accum * world_size;
}

// Note [Each model's recipe]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// One set of hyperparameters cannot serve every model: at mlp's batch 256 and lr 0.1, d2l's
// sigmoid LeNet sits on its initial plateau (loss 2.30) for the 240 steps of 10 epochs on the
// shipped 6,000 images, and SimpleCNN, whose global pooling comes straight after two
// convolutions, is still near 0.35 (docs/benchmarks.md, "Each model's recipe"). So the flags a
// recipe covers take, when the command line leaves them out, the chosen model's values below:
// each reaches a sensible accuracy on the shipped set at its defaults (docs/training.md lists what
// each reaches, tests/trainer/runs/test_model_recipes.cpp checks that each learns). A flag given
// always wins, and the log names the values the recipe supplied. torchvision's ResNets are
// made for 224x224 images; on the shipped 28x28 set resnet50 diverges at torchvision's
// ImageNet lr of 0.1 (loss ~10 after 2 epochs) and learns at 0.02 (0.687 after 2 epochs;
// resnet34 0.738 there, 0.265 at 0.1).
const std::vector<ModelRecipe>& model_recipes() {
  static const std::vector<ModelRecipe> recipes = {
      {"mlp", "default", 0.1, 0.9, 256, 10},
      {"lenet", "xavier", 0.1, 0.9, 64, 30},
      {"simplecnn", "default", 0.2, 0.9, 32, 10},
      {"resnet18", "default", 0.1, 0.9, 256, 10},
      {"resnet34", "default", 0.02, 0.9, 256, 10},
      {"resnet50", "default", 0.02, 0.9, 256, 10},
  };
  return recipes;
}

// Note [One table of flags]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Each flag of mtrain-train is one row of train_flags(): its name, --help section and text,
// how its text becomes the option's value (with the range or choices it accepts, said once),
// how that value is shown (in --help's default, the recipe's log line, and the start-up
// comparison of the ranks), and whether every rank must give it alike (Note [Which flags must
// agree] in setup/agreement.cpp). --help, the parser, the validation of a TrainOptions filled
// by hand and the ranks' comparison all read the table, so a new flag is one row and a field of
// TrainOptions; rules between flags stay in validate_train_options. A value with structure or
// a fixed set of names is parsed once, by its row, into a Given<T>: the run reads the typed
// value and never parses or compares the words again; the words stay beside it for the log,
// the ranks' comparison and the checkpoints (whose stored settings are the words, so files
// written before keep resuming).
namespace {

using ReadFlag = std::function<void(TrainOptions& o, const std::string& flag, const std::string& text)>;
using CheckFlag = std::function<void(const TrainOptions& o, const std::string& flag)>;
using ShowFlag = std::function<std::string(const TrainOptions& o)>;

struct TrainFlag {
  TrainFlag(std::string flag_name, std::string help_group, std::string help_text)
      : name(std::move(flag_name)), group(std::move(help_group)), help(std::move(help_text)) {}

  std::string name;   // without the dashes
  std::string group;  // --help's section
  std::string help;
  bool is_switch = false;
  FlagAgreement agreement = FlagAgreement::kAllRanks;
  bool help_default = false;  // --help shows show(TrainOptions{})
  bool from_recipe = false;   // the model's recipe supplies it when absent (Note [Each model's recipe])
  ReadFlag read;              // the given text into the options (a switch: called when on, with "")
  CheckFlag check;            // the value's own range or choices; empty: any value the reader stores
  ShowFlag show;              // the value as text
  ShowFlag compared;          // what the ranks compare; empty: show
};

std::string on_off(bool on) { return on ? "on" : "off"; }

// An integer in [min, max] (a max of INT64_MAX: no upper bound); the range is said here only.
template <class T>
TrainFlag integer(std::string name, std::string group, std::string help, T TrainOptions::*field, int64_t min,
                  int64_t max) {
  TrainFlag f{std::move(name), std::move(group), std::move(help)};
  f.read = [=](TrainOptions& o, const std::string& flag, const std::string& text) {
    o.*field = static_cast<T>(env::parse_int(text, flag, min, max));
  };
  f.check = [=](const TrainOptions& o, const std::string& flag) {
    env::parse_int(std::to_string(o.*field), flag, min, max);
  };
  f.show = [=](const TrainOptions& o) { return std::to_string(o.*field); };
  return f;
}

// An integer in [min, max], or absent ("unset").
template <class T>
TrainFlag optional_integer(std::string name, std::string group, std::string help,
                           std::optional<T> TrainOptions::*field, int64_t min, int64_t max) {
  TrainFlag f{std::move(name), std::move(group), std::move(help)};
  f.read = [=](TrainOptions& o, const std::string& flag, const std::string& text) {
    o.*field = static_cast<T>(env::parse_int(text, flag, min, max));
  };
  f.check = [=](const TrainOptions& o, const std::string& flag) {
    if (o.*field) env::parse_int(std::to_string(*(o.*field)), flag, min, max);
  };
  f.show = [=](const TrainOptions& o) { return o.*field ? std::to_string(*(o.*field)) : std::string("unset"); };
  return f;
}

// A finite number that `in_range` accepts (else it throws, naming the flag and the range).
TrainFlag number(std::string name, std::string group, std::string help, double TrainOptions::*field,
                 std::function<void(double value, const std::string& flag)> in_range) {
  TrainFlag f{std::move(name), std::move(group), std::move(help)};
  f.read = [=](TrainOptions& o, const std::string& flag, const std::string& text) {
    o.*field = parse_double(text, flag);
  };
  f.check = [=](const TrainOptions& o, const std::string& flag) { in_range(o.*field, flag); };
  f.show = [=](const TrainOptions& o) { return fmt::format("{}", o.*field); };
  return f;
}

// `ok(value)` or InvalidArgument "FLAG: expected EXPECTED, found VALUE".
std::function<void(double, const std::string&)> within(std::function<bool(double)> ok, std::string expected) {
  return [=](double v, const std::string& flag) {
    if (!(std::isfinite(v) && ok(v))) throw InvalidArgument(fmt::format("{}: expected {}, found {}", flag, expected, v));
  };
}

// One of `valid`.
TrainFlag choice(std::string name, std::string group, std::string help, std::string TrainOptions::*field,
                 std::vector<std::string> valid) {
  TrainFlag f{std::move(name), std::move(group), std::move(help)};
  f.read = [=](TrainOptions& o, const std::string&, const std::string& text) { o.*field = text; };
  f.check = [=](const TrainOptions& o, const std::string& flag) { check_choice(flag, o.*field, valid); };
  f.show = [=](const TrainOptions& o) { return o.*field; };
  return f;
}

// A value parsed once from its text by `parse` (which throws naming the flag); the text is
// kept beside it (Given).
template <class T>
TrainFlag given(std::string name, std::string group, std::string help, Given<T> TrainOptions::*field,
                std::type_identity_t<std::function<T(const std::string& text, const std::string& flag)>> parse) {
  TrainFlag f{std::move(name), std::move(group), std::move(help)};
  f.read = [=](TrainOptions& o, const std::string& flag, const std::string& text) {
    o.*field = Given<T>{text, parse(text, flag)};
  };
  f.show = [=](const TrainOptions& o) { return (o.*field).text; };
  return f;
}

// A parser that names its flag itself.
template <class T>
std::function<T(const std::string&, const std::string&)> by(T (*parse)(const std::string&)) {
  return [parse](const std::string& text, const std::string&) { return parse(text); };
}

// A file or directory; empty means unset. The ranks compare whether it is given, not where.
TrainFlag path(std::string name, std::string group, std::string help, std::string TrainOptions::*field) {
  TrainFlag f{std::move(name), std::move(group), std::move(help)};
  f.read = [=](TrainOptions& o, const std::string& flag, const std::string& text) {
    if (text.empty()) throw InvalidArgument(fmt::format("{}: expected a path, found an empty string", flag));
    o.*field = text;
  };
  f.show = [=](const TrainOptions& o) { return o.*field; };
  f.compared = [=](const TrainOptions& o) { return std::string((o.*field).empty() ? "unset" : "set"); };
  return f;
}

// A switch that sets `field` to `when_given` (--no-eval sets eval to false); "on" when given.
TrainFlag switch_flag(std::string name, std::string group, std::string help, bool TrainOptions::*field,
                      bool when_given = true) {
  TrainFlag f{std::move(name), std::move(group), std::move(help)};
  f.is_switch = true;
  f.read = [=](TrainOptions& o, const std::string&, const std::string&) { o.*field = when_given; };
  f.show = [=](const TrainOptions& o) { return on_off(o.*field == when_given); };
  return f;
}

TrainFlag per_rank(TrainFlag f) {
  f.agreement = FlagAgreement::kPerRank;
  return f;
}
TrainFlag shown_default(TrainFlag f) {
  f.help_default = true;
  return f;
}
TrainFlag from_recipe(TrainFlag f) {
  f.from_recipe = true;
  return f;
}

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
// The optimizer works in float32: a larger value would become infinity there.
constexpr double kFloatMax = std::numeric_limits<float>::max();

std::vector<TrainFlag> train_flags(const TrainChoices& choices) {
  const char* data = "Model and data";
  const char* training = "Training";
  const char* device = "Device";
  const char* distributed = "Distributed";
  const char* output = "Output";
  std::vector<TrainFlag> flags;
  const auto add = [&](TrainFlag f) { flags.push_back(std::move(f)); };
  using O = TrainOptions;

  // A name of the zoo, or an ONNX file (models/zoo.h), read when the run builds it.
  TrainFlag model = choice("model", data, fmt::format("model: {}, or FILE.onnx (a network PyTorch exported in training mode; docs/training.md)", fmt::join(choices.models, "|")), &O::model, choices.models);
  model.check = [valid = choices.models](const TrainOptions& o, const std::string& flag) {
    std::vector<std::string> names = valid;
    names.push_back("FILE.onnx");
    if (!models::is_onnx_file(o.model)) check_choice(flag, o.model, names);
  };
  add(shown_default(std::move(model)));
  add(shown_default(choice("dataset", data, fmt::format("dataset: {}", fmt::join(choices.datasets, "|")), &O::dataset,
                           choices.datasets)));
  // The training set's fingerprint is compared instead.
  add(per_rank(path("data-dir", data, "directory with the IDX files (default: data/<dataset> if it holds the full set, else the shipped mini set)", &O::data_dir)));
  add(from_recipe(given("init", data, "initialisation: default (PyTorch's) | normal (N(0, 0.01) conv/linear weights, as d2l) | xavier (nn.init.xavier_uniform_ conv/linear weights, d2l's LeNet recipe); default: the model's recipe", &O::init, init_scheme)));
  // Whether it is given (rank 0's weights are broadcast, so the file may differ): a rank given
  // it alone is told so by name.
  add(path("init-from", data, "start from the weights in this safetensors file", &O::init_from));
  add(shown_default(integer("seed", data, "seed for initialisation, shuffling and synthetic data", &O::seed, 0, kMax)));
  add(shown_default(given("synthetic-shape", data, "--dataset synthetic: its images' CxHxW (3x224x224 for ImageNet-sized benchmarks without data; 6,000 training images at 1x28x28, fewer when larger: about 256 MiB of them)", &O::synthetic_shape, by(parse_image_shape))));

  add(from_recipe(integer("epochs", training, "passes over the training set (default: the model's recipe)", &O::epochs, 1, 1'000'000)));
  add(optional_integer("max-steps", training, "stop after this many optimizer steps in total (default: no limit; 0 trains nothing, so --save-final writes the initial weights)", &O::max_steps, 0, kMax));
  add(from_recipe(integer("batch-size", training, "images per rank per micro-batch (x world size x --grad-accum per optimizer step; default: the model's recipe)", &O::batch_size, 1, 1'000'000)));
  add(from_recipe(number("lr", training, "learning rate (default: the model's recipe)", &O::lr,
                         within([](double v) { return v > 0 && v <= kFloatMax; },
                                fmt::format("a number > 0 and at most {:g} (float32's largest)", kFloatMax)))));
  add(from_recipe(number("momentum", training, "SGD momentum, in [0, 1) (default: the model's recipe)", &O::momentum,
                         within([](double v) { return v >= 0 && v < 1; }, "a number in [0, 1)"))));
  add(shown_default(number("weight-decay", training, "L2 penalty added to the gradient (torch.optim.SGD weight_decay)", &O::weight_decay,
                           within([](double v) { return v >= 0 && v <= kFloatMax; },
                                  fmt::format("a number >= 0 and at most {:g}", kFloatMax)))));
  add(switch_flag("nesterov", training, "Nesterov momentum", &O::nesterov));
  add(switch_flag("no-shuffle", training, "read the training set in file order (to compare runs with other frameworks)", &O::shuffle, false));
  add(shown_default(given("shuffle-order", training, "the shuffled order: mtrain (its own generator) | torch (torch.randperm's for a generator seeded --seed + epoch, as PyTorch's DistributedSampler draws it)", &O::shuffle_order, by(data::parse_permutation))));  // the one place that knows the names
  add(optional_integer("random-crop", training, "training images: torchvision's RandomCrop(size, padding=PAD), the image's own size after PAD zero pixels on every side (CIFAR recipes use 4)", &O::random_crop, 0, 4096));
  add(switch_flag("random-flip", training, "training images: torchvision's RandomHorizontalFlip() (mirrored with probability 1/2)", &O::random_flip));
  add(shown_default(given("normalize", training, "pixels/255 then (x - mean) / std per channel: none | auto (the training set's mean and std, computed once) | M1,M2,M3:S1,S2,S3 (one value each, or one per channel)", &O::normalize, by(parse_normalize))));
  add(switch_flag("skip-bad-images", training, "--dataset imagefolder or webdataset: leave out (and count in the log) files or samples that are not images or do not decode, instead of stopping", &O::skip_bad_images));
  add(optional_integer("random-resized-crop", training, "--dataset webdataset or imagefolder (which then reads its images per batch): training images through torchvision's RandomResizedCrop(N) (scale 0.08 to 1, aspect 3/4 to 4/3), drawn per image and epoch", &O::random_resized_crop, 1, 65536));
  add(optional_integer("center-crop", training, "--dataset webdataset or imagefolder (which then reads its images per batch): evaluation images (and training ones without --random-resized-crop) through Resize(S) then CenterCrop(N), S being --resize's one number, else N * 8 / 7", &O::center_crop, 1, 65536));
  add(per_rank(path("val-data", data, "--dataset webdataset: the evaluation shards, a folder or a pattern (default: DATA_DIR/val when --data-dir holds train/ and val/)", &O::val_data)));
  add(switch_flag("full-decode", training, "--dataset webdataset, or an image folder read per batch: decode every JPEG at its full size, as torchvision's loader does (its bytes exactly); by default a JPEG the transform shrinks is decoded at 1/2, 1/4 or 1/8 scale where what it makes stays as large (as PIL's draft())", &O::full_decode));
  add(per_rank(optional_integer("loader-workers", training, "threads per rank that read, decode and assemble batches (torch's DataLoader num_workers; default: 1 for a set held in memory, 4 for --dataset webdataset, which decodes every image each epoch)", &O::loader_workers, 1, 256)));
  add(shown_default(integer("shuffle-buffer", training, "--dataset webdataset: samples in each rank's shuffle buffer, which mixes the samples of the shards it reads", &O::shuffle_buffer, 1, 100'000'000)));
  add(shown_default(given("resize", training, "--dataset imagefolder or webdataset: every image resampled to HxW as it is decoded (torchvision's Resize((H, W)) on a PIL image, bilinear); N means NxN; off keeps each image's size, which must then be one", &O::resize, by(parse_resize))));
  add(switch_flag("drop-last", training, "the training sampler drops the last N mod world-size images instead of repeating some (DistributedSampler's drop_last); with --global-batch-size, the last partial global batch", &O::drop_last));
  // Host kernel threads.
  add(per_rank(optional_integer("threads", training, "intra-op threads (default: OMP_NUM_THREADS if set, else 1 per rank when several ranks share the node, else every core)", &O::threads, 1, 4096)));

  // Compared as the device it resolves to (training_configuration in setup/agreement.cpp).
  TrainFlag where = shown_default(given("device", device, "where each replica trains: auto (its GPU when one is usable, else the CPU) | cuda | cpu", &O::device, one_of<DeviceChoice>({{"auto", DeviceChoice::kAuto}, {"cuda", DeviceChoice::kCuda}, {"cpu", DeviceChoice::kCpu}})));
  where.agreement = FlagAgreement::kAsResolved;
  add(std::move(where));
  // A GPU's own algorithm choices and layout: float rounding alone; the gradients are averaged.
  add(per_rank(switch_flag("cudnn-benchmark", device, "GPU: time cuDNN's convolution algorithms for each new shape and keep the fastest (torch.backends.cudnn.benchmark)", &O::cudnn_benchmark)));
  add(per_rank(switch_flag("deterministic", device, "GPU: only convolution algorithms cuDNN documents as deterministic (torch.backends.cudnn.deterministic)", &O::deterministic)));
  add(per_rank(switch_flag("no-tf32", device, "GPU: full float32 convolutions, no TF32 tensor cores (matrix products never use TF32)", &O::allow_tf32, false)));
  add(per_rank(switch_flag("channels-last", device, "keep activations [N, H, W, C] in memory (PyTorch's channels_last), the layout cuDNN's tensor-core convolutions take natively; on the CPU only slower", &O::channels_last)));
  add(per_rank(switch_flag("cuda-graphs", device, "GPU: capture each step's forward, loss and backward as a CUDA graph once and replay it, one launch instead of hundreds (torch.cuda.graphs); where a run cannot, one log line says why", &O::cuda_graphs)));
  // A rank rounding its operands differently would send gradients of another size into the average.
  add(shown_default(given("amp", device, "mixed precision: off | bf16 | fp16 (convolutions and linear layers multiply in 16 bits, everything else stays float32; bf16 needs a GPU of compute capability 8.0+ or an AVX-512 CPU, at full speed with AVX512_BF16; fp16 a GPU of 7.0+, or a CPU where oneDNN has float16 convolutions, which Debian 12's oneDNN 2.6 has on none)", &O::amp, one_of<DType>({{"off", DType::Float32}, {"bf16", DType::BFloat16}, {"fp16", DType::Float16}}))));
  TrainFlag scaling = shown_default(given("loss-scale", device, "auto (dynamic with --amp fp16, else none) | dynamic (scale the loss, skip steps whose gradients overflow, as GradScaler) | none", &O::loss_scale, one_of<LossScaling>({{"auto", LossScaling::kAuto}, {"dynamic", LossScaling::kDynamic}, {"none", LossScaling::kNone}})));
  scaling.compared = [](const TrainOptions& o) { return std::string(uses_loss_scaler(o) ? "dynamic" : "none"); };
  add(std::move(scaling));
  // A normal float32 whose reciprocal is finite (both multiply gradients in float32).
  add(shown_default(number("initial-loss-scale", device, "the dynamic loss scale's starting value", &O::initial_loss_scale,
                           within([](double v) { return v >= std::numeric_limits<float>::min() && v <= kFloatMax; },
                                  "a number from 1.2e-38 to 3.4e38 (a normal float32)"))));
  add(shown_default(integer("loss-scale-growth-interval", device, "steps with finite gradients after which the dynamic loss scale doubles", &O::loss_scale_growth_interval, 1, kMax)));

  add(shown_default(given("backend", distributed, backend_help(), &O::backend, backend_choice)));
  // The cap becomes a byte count (size_t): bounded so that the conversion is defined.
  add(shown_default(number("bucket-cap-mb", distributed, "gradient bucket size cap in MiB (the first bucket is 1 MiB)", &O::bucket_cap_mb,
                           within([](double v) { return v > 0 && v <= 1e6; }, "a number > 0 and at most 1e6"))));
  add(shown_default(given("grad-compression", distributed, "none | bf16 | fp16: all-reduce the gradient buckets in 16 bits (DDP's bf16/fp16 compress hooks)", &O::grad_compression, one_of<DType>({{"none", DType::Float32}, {"bf16", DType::BFloat16}, {"fp16", DType::Float16}}))));
  add(shown_default(integer("grad-accum", distributed, "micro-batches per optimizer step; gradients are exchanged on the last only", &O::grad_accum, 1, 1'000'000)));
  add(shown_default(integer("check-replicas", distributed, "every N optimizer steps verify that every rank holds the same parameters (0 = never)", &O::check_replicas, 0, kMax)));
  add(switch_flag("sync-bn", distributed, "convert every BatchNorm2d to SyncBatchNorm (statistics over the global batch)", &O::sync_bn));
  add(optional_integer("global-batch-size", distributed, "images per optimizer step over all ranks, split like torch.chunk (instead of --batch-size per rank)", &O::global_batch_size, 1, 1'000'000));
  // Every rank must split each global batch the same way (and time its steps for auto).
  add(shown_default(given("balance", distributed, "with --global-batch-size: even (torch.chunk's split) | auto (split by each rank's measured speed) | static:N0,N1,... (one share per rank, summing to the global batch)", &O::balance, by(parse_balance))));
  // Whole milliseconds, added to clock readings: from 1 ms to about 115 days.
  add(shown_default(number("timeout", distributed, "seconds any collective may take before the run fails", &O::timeout_seconds,
                           within([](double v) { return v >= 0.001 && v <= 1e7; }, "a number of seconds from 0.001 to 1e7"))));
  // Whether this rank accepts a store without a secret.
  add(per_rank(switch_flag("unauthenticated-store", distributed, "workers started without mtrain-launch, MPI or MTRAIN_STORE_TOKEN: let rank 0 host the rendezvous store without a secret on an address other hosts can reach, where anyone who reaches it can join or disrupt the job", &O::unauthenticated_store)));
  add(shown_default(given("lr-scaling", distributed, "none | linear (lr x world size)", &O::lr_scaling, one_of<LrScaling>({{"none", LrScaling::kNone}, {"linear", LrScaling::kLinear}}))));
  add(shown_default(number("warmup-epochs", distributed, "linear warm-up from --lr to the scaled rate over this many epochs", &O::warmup_epochs,
                           within([](double v) { return v >= 0; }, "a number >= 0"))));
  add(shown_default(given("lr-schedule", distributed, "constant | step (x0.1 at 50% and 75%) | cosine", &O::lr_schedule, one_of<LrScheduleKind>({{"constant", LrScheduleKind::Constant}, {"step", LrScheduleKind::Step}, {"cosine", LrScheduleKind::Cosine}}))));

  // Rank 0 writes the file and every rank learns the outcome in a collective.
  add(path("save-final", output, "write every parameter and buffer to this safetensors file at the end", &O::save_final));
  add(path("save-onnx", output, "with --model FILE.onnx: write the trained graph (the same nodes, every initializer holding its trained value) to this ONNX file at the end", &O::save_onnx));
  add(path("checkpoint-dir", output, "keep checkpoints (model, momentum, position) in DIR: the latest, DIR/checkpoint.safetensors, and the one before, DIR/checkpoint.previous.safetensors; resume from the latest that passes its checks", &O::checkpoint_dir));
  add(shown_default(integer("checkpoint-every", output, "also checkpoint every N optimizer steps (checkpoints are always written at the end of each epoch and when a stop signal arrives)", &O::checkpoint_every, 0, kMax)));
  // Written, or drawn, by rank 0 alone.
  add(per_rank(path("metrics", output, "write JSON lines (one object per logged step and per epoch) to this file", &O::metrics)));
  add(per_rank(path("plot", output, "draw the training curves (train loss, train and test accuracy per epoch, as d2l) to this .png or .svg file, redrawn after every epoch", &O::plot)));
  add(switch_flag("no-eval", output, "skip the test-set evaluation at the end of each epoch", &O::eval, false));
  // Rank 0 alone logs at info level; progress lines and step events are rank 0's, no collective.
  add(per_rank(shown_default(given("log-level", output, "trace|debug|info|warn|error|critical|off", &O::log_level, log_level))));
  add(per_rank(shown_default(integer("log-every", output, "optimizer steps between progress lines", &O::log_every, 1, kMax))));
  // Tracing aligns the ranks' clocks with barriers; each rank may write to a directory of its own.
  add(path("trace", output, "write a timeline (Chrome trace events: forward, backward, each bucket's all-reduce, SyncBatchNorm, data, optimizer, evaluation, checkpoints) to DIR/rank-R.json per rank, merged into DIR/trace.json for Perfetto or chrome://tracing", &O::trace_dir));
  // What each rank records, no collective.
  TrainFlag steps{"trace-steps", output, "the optimizer steps --trace records, FIRST:LAST (evaluations and checkpoints are always recorded)"};
  steps.read = [](TrainOptions& o, const std::string& flag, const std::string& text) {
    read_step_range(text, flag, o.trace_first_step, o.trace_last_step);
  };
  steps.check = [](const TrainOptions& o, const std::string& flag) {
    int64_t first = 0, last = 0;
    read_step_range(fmt::format("{}:{}", o.trace_first_step, o.trace_last_step), flag, first, last);
  };
  steps.show = [](const TrainOptions& o) { return fmt::format("{}:{}", o.trace_first_step, o.trace_last_step); };
  add(per_rank(shown_default(std::move(steps))));
  add(per_rank(shown_default(number("progress-every", output, "in a log file or under a scheduler: a progress line (training or evaluation) whenever this many seconds passed without one; on a terminal a bar redraws in place instead", &O::progress_every,
                                    within([](double v) { return v > 0 && v <= 1e6; }, "a number of seconds > 0 and at most 1e6")))));
  return flags;
}

cxxopts::Options train_command_spec(const std::vector<TrainFlag>& flags) {
  const TrainOptions defaults;
  cxxopts::Options spec("mtrain-train", "Train an image classifier with data-parallel SGD (one replica per process; see docs/training.md).");
  spec.set_width(100);
  for (const TrainFlag& f : flags) {
    auto adder = spec.add_options(f.group);
    if (f.is_switch) {
      adder(f.name, f.help);
    } else if (f.help_default) {
      adder(f.name, f.help, cxxopts::value<std::string>()->default_value(f.show(defaults)));
    } else {
      adder(f.name, f.help, cxxopts::value<std::string>());
    }
  }
  spec.add_options(flags.back().group)("h,help", "print this help");
  return spec;
}

// The values the recipe supplied, as flags, for the log ("--init xavier --lr 0.1 ...").
std::string describe_recipe(const std::vector<TrainFlag>& flags, const cxxopts::ParseResult& r, const TrainOptions& o) {
  if (recipe_for(o.model) == nullptr) return {};
  std::vector<std::string> taken;
  for (const TrainFlag& f : flags) {
    if (!f.from_recipe || r.count(f.name) != 0) continue;
    if (f.name == "init" && !o.init_from.empty()) continue;           // the file's weights, not an init
    if (f.name == "batch-size" && o.global_batch_size) continue;      // the global batch rules
    taken.push_back(fmt::format("--{} {}", f.name, f.show(o)));
  }
  return fmt::format("{}", fmt::join(taken, " "));
}

// Each flag's own check, then the rules between flags (validate_train_options).
void validate_with(const std::vector<TrainFlag>& flags, const TrainOptions& o);

// Every flag given, in the table's order, after --model and the recipe it brings.
void read_given(const std::vector<TrainFlag>& flags, const cxxopts::ParseResult& r, TrainOptions& o) {
  const auto read = [&](const TrainFlag& f) {
    if (r.count(f.name) == 0) return;
    if (f.is_switch) {
      if (r[f.name].as<bool>()) f.read(o, "--" + f.name, "");  // --sync-bn=false is off
    } else {
      f.read(o, "--" + f.name, r[f.name].as<std::string>());
    }
  };
  for (const TrainFlag& f : flags) {
    if (f.name == "model") read(f);
  }
  apply_model_recipe(o);
  for (const TrainFlag& f : flags) {
    if (f.name != "model") read(f);
  }
  if (r.count("global-batch-size") != 0 && r.count("batch-size") != 0) {
    throw InvalidArgument(fmt::format(
        "--batch-size {} and --global-batch-size {}: give one; --batch-size is per rank, --global-batch-size "
        "is split across the ranks",
        r["batch-size"].as<std::string>(), r["global-batch-size"].as<std::string>()));
  }
}

}  // namespace

std::vector<std::string> train_flag_names() {
  std::vector<std::string> names;
  for (const TrainFlag& f : train_flags(TrainChoices{})) names.push_back("--" + f.name);
  return names;
}

std::vector<ComparedFlag> flags_ranks_compare(const TrainOptions& o) {
  std::vector<ComparedFlag> out;
  for (const TrainFlag& f : train_flags(TrainChoices{})) {
    if (f.agreement == FlagAgreement::kAllRanks) out.push_back({"--" + f.name, (f.compared ? f.compared : f.show)(o)});
  }
  return out;
}

std::vector<std::string> per_rank_flags() {
  std::vector<std::string> names;
  for (const TrainFlag& f : train_flags(TrainChoices{})) {
    if (f.agreement == FlagAgreement::kPerRank) names.push_back("--" + f.name);
  }
  return names;
}

ParsedTrainCommandLine parse_train_command_line(int argc, const char* const* argv,
                                                const TrainChoices& choices) {
  const std::vector<TrainFlag> flags = train_flags(choices);
  cxxopts::Options spec = train_command_spec(flags);
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
  read_given(flags, r, out.options);
  out.options.recipe = describe_recipe(flags, r, out.options);
  validate_with(flags, out.options);
  return out;
}

// Each flag's own range or choices (train_flags), then the rules between flags.
void validate_train_options(const TrainOptions& o, const TrainChoices& choices) {
  validate_with(train_flags(choices), o);
}

namespace {

void validate_with(const std::vector<TrainFlag>& flags, const TrainOptions& o) {
  for (const TrainFlag& f : flags) {
    if (f.check) f.check(o, "--" + f.name);
  }
  data::require_folder_options_apply(o.dataset, image_folder_options(o));
  streamed_options(o);
  for (const auto& [flag, given, imagefolder] :
       {std::tuple{"--random-resized-crop", o.random_resized_crop.has_value(), true},
        {"--center-crop", o.center_crop.has_value(), true},
        {"--val-data", !o.val_data.empty(), false}}) {
    if (!given || o.dataset == "webdataset" || (imagefolder && o.dataset == "imagefolder")) continue;
    throw InvalidArgument(fmt::format("{} applies to --dataset webdataset{}, not to {}", flag,
                                      imagefolder ? " or imagefolder" : "", o.dataset));
  }
  if (o.dataset != "synthetic" && o.synthetic_shape.text != "1x28x28") {
    throw InvalidArgument(fmt::format("--synthetic-shape applies to --dataset synthetic, not to {}", o.dataset));
  }
  if (!o.save_onnx.empty() && !models::is_onnx_file(o.model)) {
    throw InvalidArgument(fmt::format("--save-onnx {} writes back the graph of an ONNX --model, but the model is {}; "
                                      "use --save-final for its weights",
                                      o.save_onnx, o.model));
  }
  if (o.channels_last && models::is_onnx_file(o.model)) {
    throw InvalidArgument(fmt::format("--channels-last: a model from an ONNX file ({}) runs [N, C, H, W] only; leave "
                                      "the flag out",
                                      o.model));
  }
  if (o.nesterov && o.momentum == 0) {
    throw InvalidArgument("--nesterov needs a momentum > 0 (as torch.optim.SGD); add --momentum 0.9");
  }
  if (o.global_batch_size && o.lr_scaling.value == LrScaling::kLinear) {
    throw InvalidArgument(
        "--lr-scaling linear multiplies --lr by the world size because a per-rank --batch-size grows the global "
        "batch with it; --global-batch-size fixes the global batch, so there is nothing to scale (give --lr for "
        "that batch)");
  }
  if (o.balance.value.kind != BalanceSpec::Kind::kEven && !o.global_batch_size) {
    throw InvalidArgument(fmt::format(
        "--balance {} splits a global batch between the ranks: give --global-batch-size G (with --batch-size every "
        "rank takes the same number of images)",
        o.balance.text));
  }
  if (o.global_batch_size && o.grad_accum > 1) {
    // The sample weighting is per micro-batch (Note [Reducer gradient weighting]);
    // accumulated micro-batches of different sizes would need per-micro-batch weights.
    throw InvalidArgument("--global-batch-size cannot be combined with --grad-accum > 1 (use --batch-size)");
  }
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty()) {
    throw InvalidArgument(fmt::format("--checkpoint-every {} needs --checkpoint-dir DIR to write to",
                                      o.checkpoint_every));
  }
  check_distinct_files(o);
}

}  // namespace

bool uses_loss_scaler(const TrainOptions& o) {
  return o.loss_scale.value == LossScaling::kDynamic ||
         (o.loss_scale.value == LossScaling::kAuto && o.amp.value == DType::Float16);
}

}  // namespace mtrain
