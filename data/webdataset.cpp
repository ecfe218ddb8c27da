#include "data/webdataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <exception>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "data/encoded_images.h"
#include "data/tar.h"

namespace mtrain::data {
namespace {

namespace fs = std::filesystem;

// The alternatives of one brace's contents: "000..012" (a range) or "a,b,c" (a list).
std::vector<std::string> brace_alternatives(const std::string& inner, const std::string& spec) {
  if (const size_t dots = inner.find(".."); dots != std::string::npos) {
    const std::string a = inner.substr(0, dots), b = inner.substr(dots + 2);
    const auto integer = [](const std::string& s, int64_t* v) {
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
      return !s.empty() && ec == std::errc() && end == s.data() + s.size() && *v >= 0;
    };
    int64_t lo = 0, hi = 0;
    if (!integer(a, &lo) || !integer(b, &hi) || lo > hi) {
      throw InvalidArgument(fmt::format("--data-dir {}: expected a range {{FIRST..LAST}} of integers with FIRST <= "
                                        "LAST, found {{{}}}",
                                        spec, inner));
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

void expand_braces(const std::string& pattern, const std::string& spec, std::vector<std::string>& out) {
  const size_t open = pattern.find('{');
  if (open == std::string::npos) {
    if (pattern.find('}') != std::string::npos) {
      throw InvalidArgument(fmt::format("--data-dir {}: a '}}' without its '{{'", spec));
    }
    out.push_back(pattern);
    return;
  }
  const size_t close = pattern.find('}', open);
  if (close == std::string::npos || pattern.find('{', open + 1) < close) {
    throw InvalidArgument(fmt::format("--data-dir {}: expected '{{...}}' braces, closed and not nested", spec));
  }
  for (const std::string& alternative : brace_alternatives(pattern.substr(open + 1, close - open - 1), spec)) {
    expand_braces(pattern.substr(0, open) + alternative + pattern.substr(close + 1), spec, out);
  }
}

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

struct ShardIndex {
  std::vector<EncodedImages::Image> images;
  std::vector<int64_t> labels;
  std::vector<std::string> problems;  // samples left out (with skipping), in order
};

// Note [Indexing shards]
// ~~~~~~~~~~~~~~~~~~~~~~
// A shard's samples are found from its headers alone, and each label from its few-byte
// .cls member; the images are not read until a batch needs them. A sample is kept when it
// has an image (.jpg, .jpeg or .png; the first if several) and a label; other members
// (.json, .txt, ...) are passed over, as a pipeline that decodes only "jpg;png" and "cls"
// passes over them. Anything else is a bad sample: named (shard, key, what is wrong) and
// an error, or left out and counted under --skip-bad-images; a shard cut short keeps the
// samples before the cut, under the same rule.
ShardIndex index_shard(const fs::path& shard, uint32_t number, bool skip_bad) {
  ShardIndex index;
  const TarListing listing = list_tar(shard);
  const auto bad = [&](std::string why) {
    if (!skip_bad) throw IoError(fmt::format("{}: {} (--skip-bad-images leaves such samples out)", shard.string(), why));
    index.problems.push_back(fmt::format("{}: {}", shard.string(), std::move(why)));
  };
  if (!listing.damage.empty()) bad(listing.damage);
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
  const ReadOnlyFile file(shard);
  for (const Sample& s : samples) {
    const TarMember* image = nullptr;
    const TarMember* label = nullptr;
    for (size_t m : s.members) {
      const std::string ext = key_and_extension(listing.members[m].name).second;
      if (image == nullptr && (ext == "jpg" || ext == "jpeg" || ext == "png")) image = &listing.members[m];
      if (label == nullptr && ext == "cls") label = &listing.members[m];
    }
    if (image == nullptr || label == nullptr) {
      bad(fmt::format("sample {} has no {} (expected KEY.jpg, .jpeg or .png and KEY.cls)", s.key,
                      image == nullptr ? "image" : "label"));
      continue;
    }
    const std::vector<uint8_t> text =
        label->size <= 32 ? file.read(label->offset, label->size, fmt::format("member {}", label->name))
                          : std::vector<uint8_t>{};
    std::string digits(text.begin(), text.end());
    while (!digits.empty() && std::isspace(static_cast<unsigned char>(digits.back())) != 0) digits.pop_back();
    int64_t value = -1;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() || value < 0) {
      bad(fmt::format("{}: expected a label, a decimal integer >= 0, found '{}'", label->name,
                      label->size <= 32 ? digits : fmt::format("{} bytes", label->size)));
      continue;
    }
    index.images.push_back({number, image->offset, image->size, image->name});
    index.labels.push_back(value);
  }
  return index;
}

// Shards are indexed on all cores (each is a few thousand small reads).
std::vector<ShardIndex> index_shards(const std::vector<fs::path>& shards, bool skip_bad) {
  std::vector<ShardIndex> indexes(shards.size());
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const unsigned threads =
      std::max(1u, std::min<unsigned>({std::thread::hardware_concurrency(), 16u, static_cast<unsigned>(shards.size())}));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (size_t k = next++; k < shards.size(); k = next++) {
        try {
          indexes[k] = index_shard(shards[k], static_cast<uint32_t>(k), skip_bad);
        } catch (...) {
          std::lock_guard lock(failure_mutex);
          if (!failure) failure = std::current_exception();
          next = shards.size();
        }
      }
    });
  }
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  return indexes;
}

}  // namespace

std::vector<fs::path> expand_shards(const std::string& spec) {
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
  expand_braces(spec, spec, names);
  std::vector<fs::path> shards;
  std::vector<std::string> missing;
  for (std::string& name : names) {
    if (!fs::is_regular_file(name, ec)) missing.push_back(name);
    shards.emplace_back(std::move(name));
  }
  if (!missing.empty()) {
    throw IoError(fmt::format("--data-dir {}: {} of its {} shard(s) are missing, the first {}{}", spec, missing.size(),
                              shards.size(), missing.front(),
                              spec.find('{') == std::string::npos ? " (expected a folder of .tar shards or a shard pattern)"
                                                                  : ""));
  }
  return shards;
}

Dataset load_webdataset(const std::vector<fs::path>& shards, const std::string& name, const ImageTransform& transform,
                        int64_t num_classes, const WebDatasetOptions& options, std::vector<std::string>& notes) {
  std::vector<ShardIndex> indexes = index_shards(shards, options.skip_bad_samples);
  std::vector<EncodedImages::Image> images;
  std::vector<int64_t> labels;
  size_t problems = 0;
  const std::string* first_problem = nullptr;
  for (ShardIndex& index : indexes) {
    for (EncodedImages::Image& image : index.images) images.push_back(std::move(image));
    labels.insert(labels.end(), index.labels.begin(), index.labels.end());
    problems += index.problems.size();
    if (first_problem == nullptr && !index.problems.empty()) first_problem = &index.problems.front();
  }
  if (problems > 0) {
    notes.push_back(fmt::format("--skip-bad-images: {} problem(s) in {}'s shards, their samples left out; the first: {}",
                                problems, name, *first_problem));
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
  const std::vector<fs::path> train_shards = expand_shards(train_spec);
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
    splits.test = load_webdataset(expand_shards(val_spec), "webdataset/val", options.eval, splits.train.num_classes(),
                                  common, splits.notes);
  } else {
    splits.test = Dataset("webdataset/train (not evaluated)", splits.train.origin(), splits.train.shape(),
                          splits.train.num_classes(), splits.train.shared_encoded(), splits.train.labels(),
                          options.train);
  }
  return splits;
}

}  // namespace mtrain::data
