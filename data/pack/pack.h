// mtrain-pack's work: an image folder (torchvision's ImageFolder layout) written as WebDataset
// shards that --dataset webdataset reads (data/webdataset.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mtrain::data {

struct PackOptions {
  int64_t shard_size = 1000;  // samples per shard (the last may hold fewer)
  uint64_t seed = 0;          // the order the samples are written in
};

struct PackedSplit {
  std::string split;                        // "train", "val", or "" for a folder of classes
  int64_t samples = 0;
  std::vector<std::filesystem::path> shards;
};

// Packs FROM/train and FROM/val (or, without them, FROM as one split of class folders) into
// TO/train/train-NNNNNN.tar and TO/val/val-NNNNNN.tar (or TO/shard-NNNNNN.tar): each image
// as NNNNNNNNN.<its extension> with NNNNNNNNN.cls holding its class number (the classes
// sorted by name as ImageFolder numbers them), each shard's index file beside it, and
// classes.txt in TO naming them
// (Note [Packing shards] in pack.cpp). IoError for a file that is not a PNG or a JPEG, or a
// place that cannot be written; InvalidArgument for shard_size < 1.
std::vector<PackedSplit> pack_image_folder(const std::filesystem::path& from, const std::filesystem::path& to,
                                           const PackOptions& options);

// Writes each shard's index file (SHARD.tar.mtrain.idx, Note [Shard index files] in
// data/shard_index.cpp), as packing does, for shards made elsewhere; returns the samples
// indexed. IoError for a shard that cannot be read or an index that cannot be written.
int64_t write_shard_indexes(const std::vector<std::filesystem::path>& shards);

}  // namespace mtrain::data
