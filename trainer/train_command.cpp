#include "trainer/train_command.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <memory>

#include "core/error.h"
#include "data/data_source.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "models/init.h"
#include "models/optim.h"
#include "models/zoo.h"
#include "tensor/cuda_runtime.h"
#include "tensor/ops.h"
#include "trainer/checkpoint.h"
#include "trainer/environment.h"
#include "trainer/evaluate.h"
#include "trainer/gradient_sync.h"
#include "trainer/metrics.h"
#include "trainer/train_loop.h"

namespace mtrain {

namespace {

// Batch assembly (uint8 -> float through a table) is far cheaper than a training step,
// so one worker keeps ahead of the loop without taking a core from the kernels.
constexpr int kLoaderWorkers = 1;
constexpr int kPrefetchDepth = 2;

void configure_logging(const std::string& level) {
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
  spdlog::set_level(spdlog::level::from_str(level));
}

// An output file's directory must exist before training starts, not after an hour of it.
void check_output_directory(const char* flag, const std::string& path) {
  if (path.empty()) return;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty() && !std::filesystem::is_directory(parent, ec)) {
    throw InvalidArgument(fmt::format("{} {}: directory {} does not exist", flag, path, parent.string()));
  }
}

// One line saying where training runs and why (ARCHITECTURE.md: "No GPU -> CPU, said
// once in the log").
void log_device(const ThreadChoice& threads) {
  const CudaInfo& cuda = cuda_info();
  const std::string cpu = fmt::format("cpu with {} intra-op thread{} ({})", threads.threads,
                                      threads.threads == 1 ? "" : "s", threads.reason);
  if (cuda.device_count == 0) {
    spdlog::info("device: {}; training runs on the CPU because there is {}", cpu, cuda_summary());
  } else {
    spdlog::info("device: {}; {} visible, but mtrain-train has no GPU kernels yet, so training runs on the CPU",
                 cpu, cuda_summary());
  }
}

void log_environment(const WorkerEnvironment& env) {
  if (env.requested_world_size > 1) {
    spdlog::warn("{}={} but mtrain-train has no process group yet: this process trains alone, "
                 "as a world of one", env.requested_world_size_source, env.requested_world_size);
  }
}

std::shared_ptr<data::DataLoader> make_loader(std::shared_ptr<const data::Dataset> dataset,
                                              std::shared_ptr<data::Sampler> sampler,
                                              int64_t batch_size) {
  data::DataLoaderOptions o;
  o.batch_size = batch_size;
  o.drop_last = false;
  o.num_workers = kLoaderWorkers;
  o.prefetch_depth = kPrefetchDepth;
  return std::make_shared<data::DataLoader>(std::move(dataset), std::move(sampler), o);
}

SafetensorsMetadata weights_metadata(const TrainOptions& o, int64_t steps) {
  return {{kWeightsModelKey, o.model}, {"mtrain.dataset", o.dataset}, {"mtrain.steps", std::to_string(steps)},
          {"mtrain.seed", std::to_string(o.seed)}, {"mtrain.init", o.init_from.empty() ? o.init : "file"}};
}

}  // namespace

TrainChoices train_choices() { return {models::model_names(), data::known_datasets()}; }

void run_train_command(const TrainOptions& o) {
  configure_logging(o.log_level);
  check_output_directory("--save-final", o.save_final);
  check_output_directory("--metrics", o.metrics);
  MetricsWriter metrics = o.metrics.empty() ? MetricsWriter() : MetricsWriter(o.metrics);

  const WorkerEnvironment env = discover_environment();
  log_environment(env);
  const ThreadChoice threads = resolve_num_threads(o.threads, env);
  ops::set_num_threads(threads.threads);
  log_device(threads);

  const data::DataSource source = data::resolve_data_dir(o.dataset, o.data_dir);
  spdlog::info("data: {}", source.description);
  data::SyntheticOptions synthetic;
  synthetic.seed = o.seed;
  data::DatasetSplits splits = data::load_splits(source, synthetic);
  auto train_set = std::make_shared<const data::Dataset>(std::move(splits.train));
  auto test_set = std::make_shared<const data::Dataset>(std::move(splits.test));
  spdlog::info("train set: {}", train_set->describe());
  spdlog::info("test set: {}", test_set->describe());

  models::InitOptions init;
  init.scheme = models::parse_init_scheme(o.init);
  init.seed = o.seed;
  std::unique_ptr<models::Module> model =
      models::build_model(o.model, static_cast<int>(train_set->channels()),
                          static_cast<int>(train_set->num_classes()), init);
  if (!o.init_from.empty()) {
    load_model_weights(o.init_from, *model);
    spdlog::info("model {}: weights from {}", o.model, o.init_from);
  } else {
    spdlog::info("model {}: {} initialisation, seed {}", o.model, o.init, o.seed);
  }
  spdlog::info("model {}: {} parameters in {} tensors, {} buffers", o.model, model->num_parameter_elements(),
               model->parameters().size(), model->buffers().size());

  models::SgdOptions sgd;
  sgd.lr = static_cast<float>(o.lr);
  sgd.momentum = static_cast<float>(o.momentum);
  sgd.weight_decay = static_cast<float>(o.weight_decay);
  sgd.nesterov = o.nesterov;
  models::Sgd optimizer(*model, sgd);
  spdlog::info("optimizer: SGD lr {} momentum {} weight decay {}{}", o.lr, o.momentum, o.weight_decay,
               o.nesterov ? " nesterov" : "");

  std::shared_ptr<data::Sampler> train_sampler;
  if (o.shuffle) {
    train_sampler = std::make_shared<data::RandomSampler>(train_set->size(), o.seed);
  } else {
    train_sampler = std::make_shared<data::SequentialSampler>(train_set->size());
  }
  auto train_loader = make_loader(train_set, train_sampler, o.batch_size);
  std::shared_ptr<data::DataLoader> test_loader;
  if (o.eval) {
    test_loader = make_loader(test_set, std::make_shared<data::SequentialSampler>(test_set->size()), o.batch_size);
  }
  spdlog::info("train loader: {}", train_loader->describe());

  LocalGradients sync;
  sync.attach(*model);

  int64_t steps = 0;
  if (o.max_steps && *o.max_steps == 0) {
    spdlog::info("--max-steps 0: no training step");
    if (test_loader) {
      const EvalResult r = evaluate(*model, *test_loader);
      spdlog::info("initial weights: test loss {:.4f}, test acc {:.3f}", r.mean_loss(), r.accuracy());
      metrics.write({{"event", "eval"},
                     {"epoch", 0},
                     {"step", 0},
                     {"test_loss", json_number(r.mean_loss())},
                     {"test_acc", r.accuracy()}});
    }
  } else {
    TrainLoopConfig config;
    config.epochs = o.epochs;
    config.max_steps = o.max_steps;
    config.log_every = o.log_every;
    config.devices = {"cpu"};
    TrainLoop loop(*model, optimizer, sync, *train_loader, test_loader.get(), metrics, config);
    const auto summaries = loop.run();
    if (!summaries.empty()) steps = summaries.back().total_steps;
  }

  if (!o.save_final.empty()) {
    save_model_weights(o.save_final, *model, weights_metadata(o, steps));
    spdlog::info("saved final weights ({} steps) to {}", steps, o.save_final);
  }
}

}  // namespace mtrain
