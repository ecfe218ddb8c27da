// mtrain-pack: an image folder as WebDataset shards for --dataset webdataset (docs/training.md,
// "Data larger than memory").
//
//   mtrain-pack --from photos --to shards --shard-size 1000
//   mtrain-pack --index 'shards/train-{000000..000146}.tar'     # index files for shards made elsewhere
//   mtrain-launch --nproc_per_node=2 train --dataset webdataset --data-dir shards --random-resized-crop 224 ...
#include <cstdio>
#include <string>

#include <cxxopts.hpp>
#include <fmt/format.h>

#include "core/error.h"
#include "core/main_guard.h"
#include "data/pack/pack.h"
#include "data/webdataset.h"

int main(int argc, char** argv) {
  return mtrain::run_main("mtrain-pack", [&] {
    cxxopts::Options spec("mtrain-pack", "Writes an image folder (FROM/train/<class>/..., FROM/val/<class>/..., or "
                                         "FROM/<class>/...) as WebDataset tar shards of KEY.jpg|png and KEY.cls, the "
                                         "samples in a seeded random order.");
    spec.add_options()("from", "the image folder", cxxopts::value<std::string>())(
        "to", "where the shards go (train/ and val/ are made in it)", cxxopts::value<std::string>())(
        "shard-size", "samples per shard", cxxopts::value<int64_t>()->default_value("1000"))(
        "seed", "seed of the order the samples are written in", cxxopts::value<uint64_t>()->default_value("0"))(
        "index",
        "instead of packing: write the index file (SHARD.tar.mtrain.idx) of each of these shards, made elsewhere (a "
        "folder of .tar files or a pattern such as 'train-{000000..000146}.tar'), so that loading them reads one file "
        "instead of every header",
        cxxopts::value<std::string>())("h,help", "this text");
    cxxopts::ParseResult r;
    try {
      r = spec.parse(argc, argv);
    } catch (const cxxopts::exceptions::exception& e) {
      throw mtrain::InvalidArgument(fmt::format("{} (see --help)", e.what()));
    }
    if (r.count("help") != 0) {
      std::fputs(spec.help().c_str(), stdout);
      return 0;
    }
    if (r.count("index") != 0) {
      if (r.count("from") != 0 || r.count("to") != 0 || r.count("shard-size") != 0 || r.count("seed") != 0) {
        throw mtrain::InvalidArgument(
            "--index indexes shards that exist: expected it without --from, --to, --shard-size and --seed");
      }
      const auto shards = mtrain::data::expand_shards(r["index"].as<std::string>(), "--index");
      const int64_t samples = mtrain::data::write_shard_indexes(shards);
      std::printf("mtrain-pack: indexed %lld samples in %zu shard(s), %s .. %s\n", static_cast<long long>(samples),
                  shards.size(), shards.front().string().c_str(), shards.back().string().c_str());
      return 0;
    }
    if (r.count("from") == 0 || r.count("to") == 0) {
      throw mtrain::InvalidArgument("expected --from FOLDER and --to FOLDER, or --index SHARDS (see --help)");
    }
    const mtrain::data::PackOptions options{r["shard-size"].as<int64_t>(), r["seed"].as<uint64_t>()};
    const std::string to = r["to"].as<std::string>();
    for (const auto& split : mtrain::data::pack_image_folder(r["from"].as<std::string>(), to, options)) {
      std::printf("mtrain-pack: %s%s%lld images in %zu shard(s), %s .. %s\n", split.split.c_str(),
                  split.split.empty() ? "" : ": ", static_cast<long long>(split.samples), split.shards.size(),
                  split.shards.front().string().c_str(), split.shards.back().string().c_str());
    }
    std::printf("mtrain-pack: class names in %s/classes.txt\n", to.c_str());
    return 0;
  });
}
