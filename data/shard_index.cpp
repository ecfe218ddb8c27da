#include "data/shard_index.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/files.h"
#include "data/tar.h"

namespace mtrain::data {
namespace {

namespace fs = std::filesystem;

// One sample's members, as the webdataset library groups them: consecutive members sharing
// a key, the key being the path up to the first '.' of the file name.
struct Sample {
  std::string key;
  std::vector<size_t> members;  // into the listing
};

std::pair<std::string, std::string> key_and_extension(const std::string& name) {
  const size_t slash = name.rfind('/');
  const size_t dot = name.find('.', slash == std::string::npos ? 0 : slash + 1);
  if (dot == std::string::npos) return {name, ""};
  std::string ext = name.substr(dot + 1);
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return {name.substr(0, dot), ext};
}

std::vector<Sample> group_samples(const TarListing& listing) {
  std::vector<Sample> samples;
  for (size_t m = 0; m < listing.members.size(); ++m) {
    auto [key, ext] = key_and_extension(listing.members[m].name);
    // Not a sample's file (as the webdataset library skips them): no extension, or a name
    // that is only an extension (".DS_Store", macOS's "._KEY.jpg" companions).
    const size_t slash = key.rfind('/');
    const std::string base = key.substr(slash == std::string::npos ? 0 : slash + 1);
    if (ext.empty() || base.empty()) continue;
    if (samples.empty() || samples.back().key != key) samples.push_back({std::move(key), {}});
    samples.back().members.push_back(m);
  }
  return samples;
}

// A label member's value, or nullopt when it is not a decimal integer >= 0 (`text` then
// holds what to quote).
std::optional<int64_t> parse_label(const std::vector<uint8_t>& bytes, std::string& text) {
  text.assign(bytes.begin(), bytes.end());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())) != 0) text.pop_back();
  int64_t value = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || value < 0) return std::nullopt;
  return value;
}

// The shard's size and modification time, as its index file records them.
std::string shard_stamp(const fs::path& shard) {
  std::error_code ec;
  const uintmax_t bytes = fs::file_size(shard, ec);
  if (ec) throw IoError(fmt::format("{}: cannot ask its size: {}", shard.string(), ec.message()));
  const auto time = fs::last_write_time(shard, ec);
  if (ec) throw IoError(fmt::format("{}: cannot ask its modification time: {}", shard.string(), ec.message()));
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(time.time_since_epoch()).count();
  return fmt::format("shard {} bytes, modified {}", bytes, ns);
}

constexpr const char* kIndexFormat = "mtrain shard index 1";

}  // namespace

// Note [Indexing shards]
// ~~~~~~~~~~~~~~~~~~~~~~
// A shard's samples are found from its headers alone, and each label from its few-byte
// .cls member; the images are not read until a batch needs them. A sample is kept when it
// has an image (.jpg, .jpeg or .png; the first if several) and a label; other members
// (.json, .txt, ...) are passed over, as a pipeline that decodes only "jpg;png" and "cls"
// passes over them. Anything else is a bad sample: named (key, what is wrong) in
// `problems`, which loading turns into an error, or into a count under --skip-bad-images; a
// shard cut short keeps the samples before the cut, under the same rule.
ShardContents list_shard(const fs::path& shard) {
  ShardContents contents;
  const TarListing listing = list_tar(shard);
  if (!listing.damage.empty()) contents.problems.push_back(listing.damage);
  const ReadOnlyFile file(shard);
  for (const Sample& s : group_samples(listing)) {
    const TarMember* image = nullptr;
    const TarMember* label = nullptr;
    for (size_t m : s.members) {
      const std::string ext = key_and_extension(listing.members[m].name).second;
      if (image == nullptr && (ext == "jpg" || ext == "jpeg" || ext == "png")) image = &listing.members[m];
      if (label == nullptr && ext == "cls") label = &listing.members[m];
    }
    if (image == nullptr || label == nullptr) {
      contents.problems.push_back(fmt::format("sample {} has no {} (expected KEY.jpg, .jpeg or .png and KEY.cls)",
                                              s.key, image == nullptr ? "image" : "label"));
      continue;
    }
    std::string text;
    const std::optional<int64_t> value =
        label->size <= 32 ? parse_label(file.read(label->offset, label->size, fmt::format("member {}", label->name)), text)
                          : std::nullopt;
    if (!value) {
      contents.problems.push_back(fmt::format("{}: expected a label, a decimal integer >= 0, found '{}'", label->name,
                                              label->size <= 32 ? text : fmt::format("{} bytes", label->size)));
      continue;
    }
    contents.samples.push_back({image->offset, image->size, *value, image->name});
  }
  return contents;
}

// Note [Shard index files]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Listing a shard reads one header per member and one label per sample: for ImageNet's 1.28 M
// samples, 3.8 M small reads by every rank before its first step: about 100 s from a cold
// local disk (docs/benchmarks.md), longer from a network file system. mtrain-pack therefore writes beside each shard
// what listing it found (`mtrain-pack --index` does so for shards made elsewhere), one text
// file read in one go:
//   mtrain shard index 1
//   shard BYTES bytes, modified NANOSECONDS
//   samples N problems P
//   OFFSET SIZE LABEL MEMBER      (N lines; newlines in a member's name become '?': the name
//   PROBLEM                        is only quoted in messages; P lines, likewise)
// Loading reads it instead of listing when the shard's size and modification time are the ones
// it records (taken before the listing, and checked again after it). A shard rewritten at the
// same size within the file system's time resolution, or given back its old time, would pass:
// index files are for shards written once. Anything else (a shard rewritten, copied without its times, an index that does
// not read) is listed from its headers as without an index, and the load's notes say so once.
fs::path shard_index_path(const fs::path& shard) { return fs::path(shard.string() + ".mtrain.idx"); }

ShardContents write_shard_index(const fs::path& shard) {
  const std::string stamp = shard_stamp(shard);  // before: a shard written meanwhile is caught
  ShardContents contents = list_shard(shard);
  if (const std::string now = shard_stamp(shard); now != stamp) {
    throw IoError(fmt::format("{}: changed while it was indexed ('{}', then '{}'); index it once it is complete",
                              shard.string(), stamp, now));
  }
  const auto one_line = [](std::string s) {
    std::replace(s.begin(), s.end(), '\n', '?');
    return s;
  };
  std::string text = fmt::format("{}\n{}\nsamples {} problems {}\n", kIndexFormat, stamp, contents.samples.size(),
                                 contents.problems.size());
  for (const ShardSample& s : contents.samples) {
    text += fmt::format("{} {} {} {}\n", s.offset, s.size, s.label, one_line(s.member));
  }
  for (const std::string& p : contents.problems) text += one_line(p) + "\n";
  replace_file(shard_index_path(shard).string(), text);
  return contents;
}

std::optional<ShardContents> read_shard_index(const fs::path& shard, std::string& why_not) {
  why_not.clear();
  const fs::path path = shard_index_path(shard);
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  const ReadOnlyFile file(shard);  // a shard that cannot be read fails the load now, as listing it would
  const auto refuse = [&](std::string why) {
    why_not = fmt::format("{}: {}", path.string(), std::move(why));
    return std::nullopt;
  };
  std::string text;
  try {
    const ReadOnlyFile index(path);
    const std::vector<uint8_t> bytes = index.read(0, index.size(), "the index");
    text.assign(bytes.begin(), bytes.end());
  } catch (const IoError& e) {
    why_not = e.what();  // names the index file
    return std::nullopt;
  }
  // A file cut short (a copy interrupted, a full disk) must not pass for a shorter one.
  if (text.empty() || text.back() != '\n') return refuse("does not end with a newline: cut short?");
  std::istringstream in(text);
  std::string format, stamp, counts;
  if (!std::getline(in, format) || !std::getline(in, stamp) || !std::getline(in, counts)) {
    return refuse("cannot read its first three lines");
  }
  if (format != kIndexFormat) return refuse(fmt::format("expected '{}' first, found '{}'", kIndexFormat, format));
  if (const std::string now = shard_stamp(shard); stamp != now) {
    return refuse(fmt::format("made for '{}', the shard is now '{}'", stamp, now));
  }
  size_t samples = 0, problems = 0;
  int end = -1;
  if (std::sscanf(counts.c_str(), "samples %zu problems %zu%n", &samples, &problems, &end) != 2 ||
      end != static_cast<int>(counts.size())) {
    return refuse(fmt::format("expected 'samples N problems P' third, found '{}'", counts));
  }
  // A sample takes two tar headers in the shard and a line of 8 bytes here, at least.
  if (samples > file.size() / 1024 || samples > text.size() / 8) {
    return refuse(fmt::format("{} samples: more than a shard of {} bytes or this file holds", samples, file.size()));
  }
  ShardContents contents;
  contents.samples.reserve(samples);
  std::string line;
  for (size_t k = 0; k < samples; ++k) {
    ShardSample s;
    int consumed = -1;
    if (!std::getline(in, line) ||
        std::sscanf(line.c_str(), "%" SCNu64 " %" SCNu64 " %" SCNd64 "%n", &s.offset, &s.size, &s.label, &consumed) !=
            3 ||
        consumed < 0 || static_cast<size_t>(consumed) >= line.size() || line[static_cast<size_t>(consumed)] != ' ' ||
        s.label < 0 || s.offset > file.size() || s.size > file.size() - s.offset) {
      return refuse(fmt::format("line {}: expected 'OFFSET SIZE LABEL MEMBER' inside the shard's {} bytes, found '{}'",
                                4 + k, file.size(), line));
    }
    s.member = line.substr(static_cast<size_t>(consumed) + 1);
    contents.samples.push_back(std::move(s));
  }
  for (size_t k = 0; k < problems; ++k) {
    if (!std::getline(in, line)) return refuse(fmt::format("ends before its {} problem line(s)", problems));
    contents.problems.push_back(line);
  }
  if (std::getline(in, line)) return refuse(fmt::format("line {}: expected the end, found '{}'", 4 + samples + problems, line));
  return contents;
}

void for_each_shard(size_t count, const std::function<void(size_t)>& work) {
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const unsigned threads =
      std::max(1u, std::min<unsigned>({std::thread::hardware_concurrency(), 16u, static_cast<unsigned>(count)}));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (size_t k = next++; k < count; k = next++) {
        try {
          work(k);
        } catch (...) {
          std::lock_guard lock(failure_mutex);
          if (!failure) failure = std::current_exception();
          next = count;
        }
      }
    });
  }
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace mtrain::data
