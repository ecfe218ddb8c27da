// WebDataset shards (--dataset webdataset): POSIX tar files whose members are samples'
// files, NAME.jpg (or .jpeg, .png) and NAME.cls (the label, a decimal integer), the
// members of one sample next to each other, as the webdataset library, img2dataset and
// mtrain-pack write them. Loading lists the shards' headers, or reads the index files
// mtrain-pack writes beside them (data/shard_index.h), and keeps the samples' places;
// images are read and decoded per batch (Dataset over EncodedImages), so memory
// does not grow with the dataset. Every error is an IoError naming the shard and member.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_decode.h"

namespace mtrain::data {

// The shards a --data-dir names, in order: a folder (its *.tar files, sorted by name), or
// a pattern with brace ranges and lists ("train-{000000..000146}.tar", "{a,b}.tar"; a
// range keeps its bounds' zero padding). IoError when a named shard is missing
// (naming the first and counting them) or a folder holds none; InvalidArgument for a
// pattern that does not read (an unclosed brace, a range backwards). Errors quote `flag`
// ("--data-dir") with the spec.
std::vector<std::filesystem::path> expand_shards(const std::string& spec, const std::string& flag);

struct WebDatasetOptions {
  // Samples without an image or a label, labels that do not read, and a shard cut short
  // are left out and counted in the splits' notes instead of stopping the load; at
  // training time an image that does not decode is left out of its batch.
  bool skip_bad_samples = false;
  int64_t channels = 3;  // images as torchvision's loader gives them: RGB
};

// One split from `shards`: images decode through `transform` (its height and width are the
// split's image size), `num_classes` 0 means one more than the largest label. Notes for
// the log are appended to `notes`.
Dataset load_webdataset(const std::vector<std::filesystem::path>& shards, const std::string& name,
                        const ImageTransform& transform, int64_t num_classes, const WebDatasetOptions& options,
                        std::vector<std::string>& notes);

// The training split from `data_dir` (a folder holding train/ with shards, a folder of
// shards, or a pattern; expand_shards) and the evaluation split from val_data. Without
// evaluation the test split is the training shards' index again (nothing reads it).
DatasetSplits load_webdataset_splits(const std::string& data_dir, const StreamedSplitsOptions& options);

}  // namespace mtrain::data
