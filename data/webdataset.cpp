#include "data/webdataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <optional>

#include "core/error.h"
#include "data/encoded_images.h"
#include "data/shard_index.h"

namespace mtrain::data {
namespace {

namespace fs = std::filesystem;

// The alternatives of one brace's contents: "000..012" (a range) or "a,b,c" (a list).
std::vector<std::string> brace_alternatives(const std::string& inner, const std::string& where) {
  if (const size_t dots = inner.find(".."); dots != std::string::npos) {
    const std::string a = inner.substr(0, dots), b = inner.substr(dots + 2);
    const auto integer = [](const std::string& s, int64_t* v) {
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
      return !s.empty() && ec == std::errc() && end == s.data() + s.size() && *v >= 0;
    };
    int64_t lo = 0, hi = 0;
    if (!integer(a, &lo) || !integer(b, &hi) || lo > hi) {
      throw InvalidArgument(fmt::format("{}: expected a range {{FIRST..LAST}} of integers with FIRST <= "
                                        "LAST, found {{{}}}",
                                        where, inner));
    }
    const bool pad = (a.size() > 1 && a[0] == '0') || (b.size() > 1 && b[0] == '0');
    const size_t width = pad ? std::max(a.size(), b.size()) : 0;
    std::vector<std::string> out;
    for (int64_t v = lo; v <= hi; ++v) out.push_back(fmt::format("{:0{}}", v, width));
    return out;
  }
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t comma; (comma = inner.find(',', at)) != std::string::npos; at = comma + 1) {
    out.push_back(inner.substr(at, comma - at));
  }
  out.push_back(inner.substr(at));
  return out;
}

void expand_braces(const std::string& pattern, const std::string& where, std::vector<std::string>& out) {
  const size_t open = pattern.find('{');
  if (open == std::string::npos) {
    if (pattern.find('}') != std::string::npos) {
      throw InvalidArgument(fmt::format("{}: a '}}' without its '{{'", where));
    }
    out.push_back(pattern);
    return;
  }
  const size_t close = pattern.find('}', open);
  if (close == std::string::npos || pattern.find('{', open + 1) < close) {
    throw InvalidArgument(fmt::format("{}: expected '{{...}}' braces, closed and not nested", where));
  }
  for (const std::string& alternative : brace_alternatives(pattern.substr(open + 1, close - open - 1), where)) {
    expand_braces(pattern.substr(0, open) + alternative + pattern.substr(close + 1), where, out);
  }
}

// A shard's contents, from its index file when that is current (Note [Shard index files]).
struct IndexedShard {
  ShardContents contents;
  std::string stale_index;  // why its index file was not used; empty when it was, or there is none
};

std::vector<IndexedShard> contents_of_shards(const std::vector<fs::path>& shards) {
  std::vector<IndexedShard> indexed(shards.size());
  for_each_shard(shards.size(), [&](size_t k) {
    IndexedShard& shard = indexed[k];
    std::optional<ShardContents> from_file = read_shard_index(shards[k], shard.stale_index);
    shard.contents = from_file ? std::move(*from_file) : list_shard(shards[k]);
  });
  return indexed;
}

}  // namespace

std::vector<fs::path> expand_shards(const std::string& spec, const std::string& flag) {
  const std::string where = fmt::format("{} {}", flag, spec);
  std::error_code ec;
  if (fs::is_directory(spec, ec)) {
    std::vector<fs::path> shards;
    for (const auto& entry : fs::directory_iterator(spec)) {
      if (entry.is_regular_file() && entry.path().extension() == ".tar") shards.push_back(entry.path());
    }
    if (shards.empty()) throw IoError(fmt::format("{}: expected WebDataset shards (*.tar files), found none", spec));
    std::sort(shards.begin(), shards.end());
    return shards;
  }
  std::vector<std::string> names;
  expand_braces(spec, where, names);
  std::vector<fs::path> shards;
  std::vector<std::string> missing;
  for (std::string& name : names) {
    if (!fs::is_regular_file(name, ec)) missing.push_back(name);
    shards.emplace_back(std::move(name));
  }
  if (!missing.empty()) {
    throw IoError(fmt::format("{}: {} of its {} shard(s) are missing, the first {}{}", where, missing.size(),
                              shards.size(), missing.front(),
                              spec.find('{') == std::string::npos ? " (expected a folder of .tar shards or a shard pattern)"
                                                                  : ""));
  }
  return shards;
}

Dataset load_webdataset(const std::vector<fs::path>& shards, const std::string& name, const ImageTransform& transform,
                        int64_t num_classes, const WebDatasetOptions& options, std::vector<std::string>& notes) {
  std::vector<EncodedImages::Image> images;
  std::vector<int64_t> labels;
  size_t problems = 0, stale = 0;
  std::string first_problem, first_stale;
  std::vector<IndexedShard> indexed = contents_of_shards(shards);
  for (size_t k = 0; k < shards.size(); ++k) {
    ShardContents& c = indexed[k].contents;
    if (!c.problems.empty() && !options.skip_bad_samples) {
      throw IoError(fmt::format("{}: {} (--skip-bad-images leaves such samples out)", shards[k].string(),
                                c.problems.front()));
    }
    for (ShardSample& s : c.samples) {
      images.push_back({static_cast<uint32_t>(k), s.offset, s.size, std::move(s.member)});
      labels.push_back(s.label);
    }
    if (problems == 0 && !c.problems.empty()) first_problem = fmt::format("{}: {}", shards[k].string(), c.problems.front());
    problems += c.problems.size();
    if (!indexed[k].stale_index.empty() && stale++ == 0) first_stale = indexed[k].stale_index;
  }
  if (problems > 0) {
    notes.push_back(fmt::format("--skip-bad-images: {} problem(s) in {}'s shards, their samples left out; the first: {}",
                                problems, name, first_problem));
  }
  if (stale > 0) {
    notes.push_back(fmt::format("{} of {}'s {} shard index file(s) not used, the shards' headers listed instead "
                                "(`mtrain-pack --index` writes them again); the first: {}",
                                stale, name, shards.size(), first_stale));
  }
  const std::string origin = fmt::format("{} WebDataset shard(s) from {}", shards.size(), shards.front().string());
  if (images.empty()) throw IoError(fmt::format("{}: no samples (expected KEY.jpg or .png with KEY.cls)", origin));
  const int64_t largest = *std::max_element(labels.begin(), labels.end());
  if (num_classes == 0) num_classes = largest + 1;
  if (largest >= num_classes) {
    const size_t at = static_cast<size_t>(std::find(labels.begin(), labels.end(), largest) - labels.begin());
    throw IoError(fmt::format("{}: label {} of {}: {} is outside the training set's {} classes (0 to {})", name,
                              largest, shards[images[at].file].string(), images[at].member, num_classes,
                              num_classes - 1));
  }
  auto stored = std::make_shared<const EncodedImages>(shards, std::move(images));
  return Dataset(name, origin, ImageShape{options.channels, transform.height, transform.width}, num_classes,
                 std::move(stored), std::move(labels), transform);
}

DatasetSplits load_webdataset_splits(const std::string& data_dir, const StreamedSplitsOptions& options) {
  std::error_code ec;
  const bool split_folders = fs::is_directory(fs::path(data_dir) / "train", ec);
  const std::string train_spec = split_folders ? (fs::path(data_dir) / "train").string() : data_dir;
  const std::vector<fs::path> train_shards = expand_shards(train_spec, "--data-dir");
  std::string val_spec = options.val_data;
  if (val_spec.empty() && split_folders && fs::is_directory(fs::path(data_dir) / "val", ec)) {
    val_spec = (fs::path(data_dir) / "val").string();
  }
  if (options.evaluate && val_spec.empty()) {
    throw InvalidArgument(fmt::format("--data-dir {}: no evaluation shards (a folder with train/ and val/, or "
                                      "--val-data SHARDS); give --val-data, or --no-eval to train without evaluating",
                                      data_dir));
  }
  DatasetSplits splits;
  WebDatasetOptions common;
  common.skip_bad_samples = options.skip_bad;
  splits.train = load_webdataset(train_shards, "webdataset/train", options.train, 0, common, splits.notes);
  if (options.evaluate) {
    splits.test = load_webdataset(expand_shards(val_spec, options.val_data.empty() ? "--data-dir" : "--val-data"), "webdataset/val", options.eval, splits.train.num_classes(),
                                  common, splits.notes);
  } else {
    splits.test = Dataset("webdataset/train (not evaluated)", splits.train.origin(), splits.train.shape(),
                          splits.train.num_classes(), splits.train.shared_encoded(), splits.train.labels(),
                          options.train);
  }
  return splits;
}

}  // namespace mtrain::data
