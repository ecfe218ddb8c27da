// mtrain-bench-loader: the input pipeline alone, as mtrain-train would read it with the same
// flags (dataset, transforms, --batch-size, --loader-workers, --seed), without a model:
// is the loader fast enough to feed a GPU? (docs/training.md, "Data larger than memory").
//
//   mtrain-bench-loader --dataset webdataset --data-dir shards --random-resized-crop 224
//       --random-flip --batch-size 64 --loader-workers 8 --max-steps 50
//
// Reads --max-steps batches (default: one epoch) of rank 0 of a world of one and prints the
// images per second after the first batch, whose time includes the workers' start.
#include <chrono>
#include <cstdio>

#include <fmt/format.h>

#include "core/error.h"
#include "core/main_guard.h"
#include "data/data_source.h"
#include "trainer/options.h"
#include "trainer/setup/start_up.h"
#include "trainer/train_command.h"

int main(int argc, char** argv) {
  return mtrain::run_main("mtrain-bench-loader", [&] {
    using Clock = std::chrono::steady_clock;
    const auto parsed = mtrain::parse_train_command_line(argc, argv, mtrain::train_choices());
    if (parsed.help) {
      std::fputs(parsed.help_text.c_str(), stdout);
      return 0;
    }
    mtrain::TrainOptions o = parsed.options;
    o.eval = false;  // only the training images are read
    if (o.normalize.value.automatic) {
      throw mtrain::InvalidArgument("--normalize auto: give the values to benchmark with (e.g. ImageNet's "
                                    "0.485,0.456,0.406:0.229,0.224,0.225)");
    }
    const auto start = Clock::now();
    const mtrain::data::DataSource source = mtrain::data::resolve_data_dir(o.dataset, o.data_dir);
    const mtrain::data::SyntheticOptions synthetic = mtrain::synthetic_options(o);
    auto splits = mtrain::data::load_splits(source, synthetic, mtrain::image_folder_options(o), mtrain::streamed_options(o));
    auto train = std::make_shared<const mtrain::data::Dataset>(std::move(splits.train));
    const double index_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const mtrain::data::ChannelStats norm{o.normalize.value.mean, o.normalize.value.std};
    const auto loader = mtrain::make_train_loader(o, train, 0, 1, false, norm).loader;
    std::printf("mtrain-bench-loader: %s, loaded in %.2f s\nloader: %s\n", train->describe().c_str(), index_seconds,
                loader->describe().c_str());
    const int64_t batches = std::min(o.max_steps.value_or(loader->num_batches()), loader->num_batches());
    if (batches < 2) throw mtrain::InvalidArgument(fmt::format("expected at least 2 batches, found {}", batches));
    loader->start_epoch(0);
    int64_t images = 0;
    auto first = Clock::now();
    for (int64_t b = 0; b < batches; ++b) {
      const auto batch = loader->next();
      if (!batch) break;
      if (b == 0) {
        first = Clock::now();
        continue;
      }
      images += batch->size();
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - first).count();
    const int workers = loader->options().num_workers;
    std::printf("%lld images in %.3f s after the first batch: %.1f images/s with %d worker(s), %.1f per worker\n",
                static_cast<long long>(images), seconds, images / seconds, workers, images / seconds / workers);
    return 0;
  });
}
