// mtrain-train's command line: the flags, their defaults and their validation. Parsing
// is separate from running so every bad value is rejected before anything is loaded.
// Pure functions; every error is InvalidArgument with one line naming the flag.
#pragma once

#include <spdlog/common.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/image_folder.h"
#include "data/random.h"
#include "data/synthetic.h"
#include "data/webdataset.h"
#include "models/init.h"
#include "tensor/tensor.h"
#include "trainer/ddp/share_policy.h"
#include "trainer/loop/lr_schedule.h"

namespace mtrain {

struct BackendInfo;  // collectives/process_group.h

// --normalize's value: none (no means), auto (computed from the training set), or the
// means and stds given.
struct Normalization {
  bool automatic = false;
  std::vector<float> mean;
  std::vector<float> std;
};
// InvalidArgument for anything but none, auto or MEANS:STDS, quoting it.
Normalization parse_normalize(const std::string& value);

// --resize's value: off (0x0), HEIGHTxWIDTH, or one N for NxN (torchvision's
// Resize((H, W)); a single int there would resize the shorter side, which leaves mixed
// sizes mixed). InvalidArgument for anything else, quoting it.
struct ImageSize {
  int64_t height = 0;
  int64_t width = 0;
};
ImageSize parse_resize(const std::string& value);

// --synthetic-shape's value: CxHxW, 1 or 3 channels. InvalidArgument otherwise, quoting it.
data::ImageShape parse_image_shape(const std::string& value);

// A flag's value as given and as parsed from it, once, by its row of the flag table (Note
// [One table of flags] in options.cpp): the run reads `value`; the log, the ranks' comparison
// and checkpoints read `text`, the words the user typed.
template <class T>
struct Given {
  std::string text;
  T value{};
};

enum class LossScaling { kAuto, kDynamic, kNone };  // --loss-scale
enum class DeviceChoice { kAuto, kCuda, kCpu };       // --device (resolved by bind_device)
// --backend: an entry of collectives' registry (known_backends()), or auto, which only the
// bound device resolves (Note [The run plan] in setup/run_plan.cpp).
struct BackendChoice {
  const BackendInfo* named = nullptr;  // null: auto
  bool automatic() const { return named == nullptr; }
};
enum class LrScaling { kNone, kLinear };              // --lr-scaling

// Defaults: the README's main job is plain `mtrain-train`, which must finish in well
// under 3 minutes on 2 cores and still learn something real: mlp for 10 epochs on the
// shipped subset does. The model's recipe (model_recipes) then supplies --init, --epochs,
// --batch-size, --lr and --momentum where the command line does not; the values here are mlp's.
struct TrainOptions {
  std::string model = "mlp";
  std::string dataset = "fashion-mnist";
  std::string data_dir;                 // empty: the data layer's default for the dataset
  int64_t epochs = 10;
  std::optional<int64_t> max_steps;     // optimizer steps in total; unset = no limit
  int64_t batch_size = 256;
  double lr = 0.1;
  double momentum = 0.9;
  double weight_decay = 0.0;
  bool nesterov = false;
  uint64_t seed = 0;
  std::optional<int> threads;           // unset: see resolve_num_threads (environment.h)
  Given<models::InitScheme> init{"default", models::InitScheme::kPyTorchDefault};  // | normal (d2l) | xavier
  bool shuffle = true;
  Given<data::Permutation> shuffle_order{"mtrain", data::Permutation::kMtrain};  // | torch (DistributedSampler's)
  bool drop_last = false;               // the training sampler drops the tail instead of padding
  // Training images only (Note [Augmentation draws] in data/dataloader.cpp): torchvision's
  // RandomCrop(size, padding) and RandomHorizontalFlip; both loaders normalise.
  std::optional<int64_t> random_crop;   // the crop's zero padding; unset = no random crop
  bool random_flip = false;
  Given<Normalization> normalize{"none", {}};  // none | auto (the training set's mean/std) | M1,M2,..:S1,S2,..
  bool skip_bad_images = false;         // imagefolder, webdataset: leave out images that do not decode
  Given<ImageSize> resize{"off", {}};   // imagefolder, webdataset: off | HxW | N (NxN), see parse_resize
  // Streamed sets (streamed_options): the training images' RandomResizedCrop size,
  // the evaluation images' CenterCrop size (after --resize N's shorter side), the evaluation
  // shards, and the training sampler's shuffle buffer (data/shard_sampler.h).
  std::optional<int64_t> random_resized_crop;
  std::optional<int64_t> center_crop;
  std::string val_data;
  int64_t shuffle_buffer = 1000;
  Given<data::ImageShape> synthetic_shape{"1x28x28", {1, 28, 28}};  // --dataset synthetic's images
  bool full_decode = false;  // streamed JPEGs always decoded at full size (torchvision's bytes)
  std::optional<int64_t> loader_workers;  // threads assembling batches; unset: 1 in memory, 4 streamed
  std::string init_from;                // safetensors to start from; empty = fresh init
  std::string save_final;               // safetensors to write at the end; empty = none
  std::string save_onnx;                // with an ONNX --model: the trained graph at the end; empty = none
  std::string metrics;                  // JSON lines file; empty = none
  std::string plot;                     // training curves redrawn after each epoch (.png/.svg); empty = none
  bool eval = true;
  Given<spdlog::level::level_enum> log_level{"info", spdlog::level::info};
  int64_t log_every = 20;               // optimizer steps between progress lines
  double progress_every = 10.0;         // seconds: the longest quiet stretch in a log (not a terminal)
  std::string trace_dir;                // timeline: DIR/rank-R.json and DIR/trace.json; empty = none
  int64_t trace_first_step = 1;         // --trace-steps FIRST:LAST, optimizer steps counted from 1
  int64_t trace_last_step = 20;
  // The flags the model's recipe supplied, as flags ("--init xavier --lr 0.1"), for the
  // log; empty when the command line gave them all (Note [Each model's recipe]).
  std::string recipe;

  // Where the replica trains (docs/gpu.md; Note [Device binding] in setup/device.cpp)
  // and the GPU numerics (Note [Convolution algorithm choice] in tensor/cuda_ops.h; all
  // three are accepted and ignored on the CPU, so one command line serves both).
  Given<DeviceChoice> device{"auto", DeviceChoice::kAuto};
  bool cudnn_benchmark = false;         // time cuDNN's algorithms per shape, keep the fastest
  bool deterministic = false;           // only algorithms cuDNN documents as deterministic
  bool allow_tf32 = true;               // TF32 tensor cores for convolutions (--no-tf32 turns off)
  bool channels_last = false;           // activations [N, H, W, C] (Note [Channels-last models])
  bool cuda_graphs = false;             // replay each step's forward and backward as a CUDA graph

  // Mixed precision (Note [Mixed precision] in models/mixed_precision.cpp) and loss
  // scaling (Note [Dynamic loss scaling] in trainer/loop/loss_scaler.cpp).
  Given<DType> amp{"off", DType::Float32};  // off (float32) | bf16 | fp16: the convolutions' compute type
  Given<LossScaling> loss_scale{"auto", LossScaling::kAuto};  // auto: dynamic with fp16, else none
  double initial_loss_scale = 65536.0;
  int64_t loss_scale_growth_interval = 2000;

  // Checkpoints and preemption (docs/training.md "Checkpoints and preemption").
  std::string checkpoint_dir;           // resume from / write DIR/checkpoint.safetensors; empty = none
  int64_t checkpoint_every = 0;         // optimizer steps between checkpoints; 0 = epoch ends and stops only

  // Distributed training (ignored in a world of one except where noted).
  Given<BackendChoice> backend{"auto", {}};  // auto | a backend of collectives' registry
  double bucket_cap_mb = 25.0;          // Reducer bucket cap (Note [Reducer buckets])
  Given<DType> grad_compression{"none", DType::Float32};  // none (float32) | bf16 | fp16 (Note [Gradient compression])
  int64_t grad_accum = 1;               // micro-batches per optimizer step (also in a world of one)
  int64_t check_replicas = 0;           // every N steps compare parameter hashes; 0 = never
  bool sync_bn = false;                 // convert BatchNorm2d to SyncBatchNorm
  std::optional<int64_t> global_batch_size;  // split across ranks instead of --batch-size per rank
  Given<BalanceSpec> balance{"even", {}};  // even | auto | static:N0,N1,... (trainer/ddp/share_policy.h)
  double timeout_seconds = 1800;        // per collective
  bool unauthenticated_store = false;   // Note [Workers without a shared secret] (worker_store.cpp)
  Given<LrScaling> lr_scaling{"none", LrScaling::kNone};  // | linear (Note [Learning-rate scaling and warm-up])
  double warmup_epochs = 0;
  Given<LrScheduleKind> lr_schedule{"constant", LrScheduleKind::Constant};  // | step | cosine
};

// What a model trains with when the command line leaves these flags out (Note [Each model's
// recipe] in options.cpp); every model of the zoo has one.
struct ModelRecipe {
  std::string model;
  std::string init;
  double lr = 0.1;
  double momentum = 0.9;
  int64_t batch_size = 256;
  int64_t epochs = 10;
};
const std::vector<ModelRecipe>& model_recipes();

struct ParsedTrainCommandLine {
  bool help = false;       // --help was given: print help_text and exit 0
  std::string help_text;
  TrainOptions options;
};

// Names the command line accepts for --model and --dataset; the caller passes the
// model zoo's list so the error for an unknown name can print every valid one.
struct TrainChoices {
  std::vector<std::string> models;
  std::vector<std::string> datasets;
};

// Parses and validates argv. Throws InvalidArgument with one line naming the flag,
// what it expects and what it got (unknown flags, stray arguments, bad numbers,
// unknown names).
ParsedTrainCommandLine parse_train_command_line(int argc, const char* const* argv,
                                                const TrainChoices& choices);

// Checks the option values (called by parse_train_command_line; exposed for tests
// and for callers that fill TrainOptions themselves). Throws InvalidArgument.
void validate_train_options(const TrainOptions& options, const TrainChoices& choices);

// The synthetic set --seed and --synthetic-shape ask for: 6,000 training and 1,000 test
// images, fewer for larger images (about 256 MiB of training images at most).
data::SyntheticOptions synthetic_options(const TrainOptions& options);

// What --skip-bad-images and --resize ask of the image folder loader.
data::ImageFolderOptions image_folder_options(const TrainOptions& options);
// What the image flags ask of --dataset webdataset: each split's transform (Note [Streamed
// images' transforms] in options.cpp), the evaluation shards, --skip-bad-images.
// InvalidArgument when the flags leave the training images' size open.
data::StreamedSplitsOptions streamed_options(const TrainOptions& options);

// Items of an epoch's order one optimizer step takes over all `world_size` ranks: the
// global batch, or batch x grad_accum x world (Note [Resuming in another world]).
int64_t items_per_step(const TrainOptions& options, int world_size);

// Every flag mtrain-train accepts, as "--name" (--help left out), in --help's order.
std::vector<std::string> train_flag_names();

// Whether the ranks of a run must give a flag alike (Note [Which flags must agree] in
// setup/agreement.cpp): each flag's row in the table says (Note [One table of flags]).
enum class FlagAgreement {
  kAllRanks,    // compared at start-up as flags_ranks_compare shows it
  kPerRank,     // changes neither what is trained nor the collectives
  kAsResolved,  // compared in the form it resolves to (--device: the device kind)
};
struct ComparedFlag {
  std::string name;   // "--lr"
  std::string value;  // as the ranks compare it ("set" for a path given, ...)
};
// Every kAllRanks flag with its value in `options`, in --help's order.
std::vector<ComparedFlag> flags_ranks_compare(const TrainOptions& options);
// Every kPerRank flag, as "--name".
std::vector<std::string> per_rank_flags();

// Whether the run scales its loss dynamically: --loss-scale dynamic, or auto with
// --amp fp16, which needs it (Note [Dynamic loss scaling] in loop/loss_scaler.cpp).
bool uses_loss_scaler(const TrainOptions& options);

}  // namespace mtrain
