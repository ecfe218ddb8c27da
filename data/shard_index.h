// What a WebDataset shard holds: each kept sample's image (its bytes' place in the tar and its
// member name) and label, and the problems that left samples out (Note [Indexing shards] in
// shard_index.cpp). Found from the shard's tar headers, or read from the index file beside it
// that mtrain-pack writes (Note [Shard index files]). Every error is an IoError naming the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mtrain::data {

struct ShardSample {
  uint64_t offset = 0;  // of the image's first byte in the shard
  uint64_t size = 0;
  int64_t label = 0;
  std::string member;   // the image's name inside the shard
};

struct ShardContents {
  std::vector<ShardSample> samples;   // in archive order
  std::vector<std::string> problems;  // why samples were left out, in order, without the shard's name
};

// Lists `shard`'s headers and reads its labels. IoError when it cannot be read or is not a
// tar at all; a shard cut short keeps the samples before the cut and says so in `problems`.
ShardContents list_shard(const std::filesystem::path& shard);

// Where `shard`'s index file goes: SHARD.tar.mtrain.idx beside SHARD.tar (the shard's own name and ".mtrain.idx").
std::filesystem::path shard_index_path(const std::filesystem::path& shard);

// Lists `shard` and writes what it found as the shard's index file, stamped with the
// shard's size and modification time before the listing; returns it. IoError when the
// shard cannot be read, changed while it was listed, or the index cannot be written.
ShardContents write_shard_index(const std::filesystem::path& shard);

// The shard's contents from its index file. nullopt with `why_not` empty when there is no
// index file; nullopt with `why_not` saying why when it does not read or does not describe
// the shard as it is now (another size or modification time). IoError when the shard itself
// cannot be opened, as listing it would.
std::optional<ShardContents> read_shard_index(const std::filesystem::path& shard, std::string& why_not);

// Runs work(k) for k in [0, count) on up to 16 threads (a shard's indexing is many small
// reads); rethrows the first exception once the threads have stopped.
void for_each_shard(size_t count, const std::function<void(size_t)>& work);

}  // namespace mtrain::data
