// WebDataset shards: tar archives read against GNU tar's own (and ours read by it),
// shard patterns, the index's rules for bad samples, the per-rank shard sampler, the
// streamed dataset through the DataLoader, and the decoded images' transforms.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <jpeglib.h>  // after <cstdio>: it needs FILE

#include "core/error.h"
#include "data/dataloader.h"
#include "data/image_decode.h"
#include "data/image_folder.h"
#include "data/pack/pack.h"
#include "data/shard_index.h"
#include "data/shard_sampler.h"
#include "data/tar.h"
#include "data/webdataset.h"
#include "tests/data/image_files.h"
#include "tests/support/error_of.h"
#include "tests/trainer/temp_dir.h"

using namespace mtrain::data;
using mtrain::IoError;
using mtrain::InvalidArgument;
using mtrain::testing::error_of;
using mtrain::testing::TempDir;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_text(const fs::path& p, const std::string& s) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << s;
}

// The output of a shell command; fails the test when it exits non-zero.
std::string shell(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  REQUIRE(::pclose(pipe) == 0);
  return out;
}

// A gray image whose every pixel is `value`, as PNG bytes.
std::vector<uint8_t> png_bytes(const TempDir& dir, int64_t h, int64_t w, uint8_t value) {
  const std::string path = dir.file("tmp.png");
  mtrain::testing::write_png(path, h, w, 1, std::vector<uint8_t>(static_cast<size_t>(h * w), value));
  const std::string s = read_text(path);
  return bytes_of(s);
}

// A shard of `count` samples, image i of value `first + i`, label i % classes.
void write_shard(const TempDir& dir, const fs::path& path, int count, int first, int classes = 3) {
  fs::create_directories(path.parent_path());
  TarWriter tar(path);
  for (int i = 0; i < count; ++i) {
    const std::string key = fmt::format("s{:04}", first + i);
    tar.add(key + ".png", png_bytes(dir, 4, 6, static_cast<uint8_t>(first + i)));
    tar.add(key + ".cls", bytes_of(std::to_string(i % classes)));
  }
  tar.finish();
}

ImageTransform resize_to(int64_t h, int64_t w) { return {ImageTransform::Kind::kResize, h, w, 0, 0}; }

}  // namespace

TEST_CASE("tar: our archives list as GNU tar and Python's tarfile list them, and theirs as they do") {
  TempDir dir;
  const fs::path ours = dir.path() / "ours.tar";
  const std::string long_name = std::string(120, 'd') + "/" + std::string(90, 'n') + ".jpg";
  {
    TarWriter tar(ours);
    tar.add("a.jpg", bytes_of("hello"));
    tar.add("b.cls", bytes_of(""));
    tar.add(long_name, std::vector<uint8_t>(1000, 7));
    tar.finish();
  }
  CHECK(shell(fmt::format("tar -tf '{}'", ours.string())) == "a.jpg\nb.cls\n" + long_name + "\n");
  CHECK(shell(fmt::format("tar -xOf '{}' a.jpg", ours.string())) == "hello");
  const TarListing listed = list_tar(ours);
  REQUIRE(listed.members.size() == 3);
  CHECK(listed.damage.empty());
  CHECK(listed.members[2].name == long_name);
  CHECK(listed.members[2].size == 1000);
  CHECK(ReadOnlyFile(ours).read(listed.members[0].offset, 5, "a.jpg") == bytes_of("hello"));

  // GNU tar's own, in its gnu (long names as 'L' members) and pax formats, with a folder entry.
  const std::string deep = std::string(150, 'x') + "/" + std::string(100, 'y') + ".cls";
  fs::create_directories(dir.path() / "src" / std::string(150, 'x'));
  write_text(dir.path() / "src" / deep, "12");
  write_text(dir.path() / "src" / "k.png", std::string(700, 'p'));
  for (const std::string format : {"gnu", "pax", "ustar"}) {
    if (format == "ustar") continue;  // a 251-byte path does not fit ustar; covered by ours above
    const fs::path theirs = dir.path() / (format + ".tar");
    shell(fmt::format("cd '{}' && tar --format={} -cf '{}' k.png '{}'", (dir.path() / "src").string(), format,
                      theirs.string(), std::string(150, 'x')));
    const TarListing l = list_tar(theirs);
    INFO(format);
    CHECK(l.damage.empty());
    REQUIRE(l.members.size() == 2);  // the folder entry is passed over
    CHECK(l.members[0].name == "k.png");
    CHECK(l.members[0].size == 700);
    CHECK(l.members[1].name == deep);
    CHECK(ReadOnlyFile(theirs).read(l.members[1].offset, l.members[1].size, deep) == bytes_of("12"));
  }
}

TEST_CASE("tar: an archive cut short keeps its whole members; a file that is no tar is refused") {
  TempDir dir;
  const fs::path path = dir.path() / "cut.tar";
  {
    TarWriter tar(path);
    tar.add("one.png", std::vector<uint8_t>(600, 1));
    tar.add("two.png", std::vector<uint8_t>(600, 2));
    tar.finish();
  }
  fs::resize_file(path, 512 + 1024 + 512 + 100);  // inside two.png's data
  const TarListing l = list_tar(path);
  REQUIRE(l.members.size() == 1);
  CHECK(l.members[0].name == "one.png");
  CHECK_THAT(l.damage, Contains("ends inside member two.png"));
  fs::resize_file(path, 512 + 1024 + 200);  // inside the second header
  CHECK_THAT(list_tar(path).damage, Contains("ends inside a header (at byte 1536"));

  write_text(dir.path() / "text.tar", std::string(2048, 'z'));
  CHECK_THAT(error_of<IoError>([&] { list_tar(dir.path() / "text.tar"); }),
             Contains("text.tar: expected a tar archive, found no tar header at byte 0"));
  CHECK_THAT(error_of<IoError>([&] { list_tar(dir.path() / "absent.tar"); }), Contains("absent.tar: cannot open it"));
  CHECK_THAT(error_of<InvalidArgument>([&] { TarWriter(dir.path() / "w.tar").add(std::string(300, 'n'), {}); }),
             Contains("cannot hold the member name"));
}

TEST_CASE("shard patterns: brace ranges keep their padding, lists, folders; missing shards are named") {
  TempDir dir;
  for (const char* name : {"t-008.tar", "t-009.tar", "t-010.tar", "a.tar", "b.tar", "notes.txt"}) {
    write_text(dir.path() / "s" / name, "");
  }
  const std::string s = (dir.path() / "s").string();
  CHECK(expand_shards(s + "/t-{008..010}.tar", "--data-dir") ==
        std::vector<fs::path>{s + "/t-008.tar", s + "/t-009.tar", s + "/t-010.tar"});
  CHECK(expand_shards(s + "/{a,b}.tar", "--data-dir") == std::vector<fs::path>{s + "/a.tar", s + "/b.tar"});
  CHECK(expand_shards(s, "--data-dir").size() == 5);  // the .tar files, sorted
  CHECK(expand_shards(s, "--data-dir").front() == fs::path(s + "/a.tar"));
  CHECK_THAT(error_of<IoError>([&] { expand_shards(s + "/t-{008..012}.tar", "--val-data"); }),
             Contains("--val-data " + s + "/t-{008..012}.tar: 2 of its 5 shard(s) are missing, the first " + s +
                      "/t-011.tar"));
  CHECK_THAT(error_of<InvalidArgument>([&] { expand_shards(s + "/t-{9..3}.tar", "--data-dir"); }), Contains("FIRST <= LAST"));
  CHECK_THAT(error_of<InvalidArgument>([&] { expand_shards(s + "/t-{1..3.tar", "--data-dir"); }), Contains("closed and not nested"));
  fs::create_directories(dir.path() / "empty");
  CHECK_THAT(error_of<IoError>([&] { expand_shards((dir.path() / "empty").string(), "--data-dir"); }), Contains("found none"));
}

TEST_CASE("webdataset index: samples grouped by key, labels from .cls, bad samples named or skipped") {
  TempDir dir;
  const fs::path good = dir.path() / "good.tar";
  write_shard(dir, good, 5, 10);
  std::vector<std::string> notes;
  const Dataset set = load_webdataset({good}, "w/train", resize_to(4, 6), 0, {}, notes);
  CHECK(set.size() == 5);
  CHECK(set.num_classes() == 3);
  CHECK(set.labels() == std::vector<int64_t>{0, 1, 2, 0, 1});
  CHECK_FALSE(set.in_memory());
  CHECK(set.shape() == ImageShape{3, 4, 6});
  std::vector<uint8_t> pixels(3 * 4 * 6);
  set.read_image(3, 0, pixels.data());
  CHECK(std::all_of(pixels.begin(), pixels.end(), [](uint8_t v) { return v == 13; }));  // gray, in 3 channels
  CHECK(notes.empty());

  const auto shard_with = [&](const std::string& name, const std::vector<std::pair<std::string, std::string>>& members) {
    const fs::path p = dir.path() / name;
    TarWriter tar(p);
    for (const auto& [member, text] : members) {
      tar.add(member, member.ends_with(".png") ? png_bytes(dir, 2, 2, 1) : bytes_of(text));
    }
    tar.finish();
    return p;
  };
  // Files that are no sample's (no extension, a name that is only an extension) are passed over.
  const fs::path extras = shard_with("extras.tar", {{"__index__", "x"}, {"._a.png", "x"}, {"a.png", ""}, {"a.cls", "1"}});
  CHECK(load_webdataset({extras}, "w", resize_to(2, 2), 0, {}, notes).size() == 1);
  const fs::path no_label = shard_with("no_label.tar", {{"a.png", ""}, {"a.cls", "1"}, {"b.png", ""}, {"b.json", "{}"}});
  const fs::path bad_label = shard_with("bad_label.tar", {{"a.png", ""}, {"a.cls", "cat"}});
  const fs::path no_image = shard_with("no_image.tar", {{"dir/a.b.txt", "x"}, {"dir/a.b.cls", "0"}});
  CHECK_THAT(error_of<IoError>([&] { load_webdataset({no_label}, "w", resize_to(2, 2), 0, {}, notes); }),
             Contains("no_label.tar: sample b has no label (expected KEY.jpg, .jpeg or .png and KEY.cls) "
                      "(--skip-bad-images leaves such samples out)"));
  CHECK_THAT(error_of<IoError>([&] { load_webdataset({bad_label}, "w", resize_to(2, 2), 0, {}, notes); }),
             Contains("bad_label.tar: a.cls: expected a label, a decimal integer >= 0, found 'cat'"));
  CHECK_THAT(error_of<IoError>([&] { load_webdataset({no_image}, "w", resize_to(2, 2), 0, {}, notes); }),
             Contains("sample dir/a has no image"));

  // Skipped: counted in one note, the rest kept; a shard cut short keeps what comes before the cut.
  const fs::path cut = dir.path() / "cut.tar";
  write_shard(dir, cut, 4, 0);
  fs::resize_file(cut, fs::file_size(cut) - 1024 - 600);  // inside the last sample's .cls header
  WebDatasetOptions skip;
  skip.skip_bad_samples = true;
  notes.clear();
  const Dataset kept = load_webdataset({no_label, bad_label, cut, good}, "w", resize_to(2, 2), 0, skip, notes);
  CHECK(kept.size() == 1 + 0 + 3 + 5);
  REQUIRE(notes.size() == 1);
  // no_label's b, bad_label's a, and in cut.tar the cut and the sample it took the label of.
  CHECK_THAT(notes[0], Contains("4 problem(s) in w's shards, their samples left out; the first") &&
                           Contains("no_label.tar: sample b has no label"));
  CHECK_THAT(error_of<IoError>([&] { load_webdataset({cut}, "w", resize_to(2, 2), 0, {}, notes); }),
             Contains("cut.tar: the archive ends inside"));
  // Evaluation labels beyond the training classes.
  CHECK_THAT(error_of<IoError>([&] { load_webdataset({good}, "w/val", resize_to(2, 2), 2, {}, notes); }),
             Contains("label 2 of") && Contains("outside the training set's 2 classes"));
}

TEST_CASE("ShardSampler: disjoint shards per rank, every sample once, equal sizes, a bounded shuffle") {
  // Shards of uneven sizes: 7, 3, 0 (empty), 10, 5, 6, 4 samples.
  const std::vector<int64_t> sizes = {7, 3, 0, 10, 5, 6, 4};
  std::vector<int64_t> starts = {0};
  for (int64_t s : sizes) starts.push_back(starts.back() + s);
  const int64_t total = starts.back();
  const auto shard_of = [&](int64_t i) {
    return static_cast<int64_t>(std::upper_bound(starts.begin(), starts.end(), i) - starts.begin()) - 1;
  };
  for (const int world : {1, 2, 3}) {
    for (const bool drop_last : {false, true}) {
      for (const int64_t epoch : {0, 1, 2}) {
        INFO(fmt::format("world {}, drop_last {}, epoch {}", world, drop_last, epoch));
        std::multiset<int64_t> seen;
        std::set<int64_t> shards_seen;
        std::vector<int64_t> lengths;
        for (int rank = 0; rank < world; ++rank) {
          ShardSampler sampler(starts, rank, world, {.shuffle = true, .seed = 5, .drop_last = drop_last, .buffer = 4});
          sampler.set_epoch(epoch);
          const std::vector<int64_t> order = sampler.indices();
          CHECK(static_cast<int64_t>(order.size()) == sampler.size());
          lengths.push_back(sampler.size());
          const std::vector<int64_t> mine = sampler.assignment()[static_cast<size_t>(rank)];
          for (const int64_t k : mine) CHECK(shards_seen.insert(k).second);  // no shard on two ranks
          std::set<int64_t> distinct;
          for (const int64_t i : order) {
            CHECK(std::find(mine.begin(), mine.end(), shard_of(i)) != mine.end());
            distinct.insert(i);
          }
          seen.insert(distinct.begin(), distinct.end());
          // The buffer: the sample used at position p was read at most `buffer` samples earlier,
          // i.e. at read position <= p + 4 in the rank's stream of its shards front to back.
          std::vector<int64_t> stream;
          for (const int64_t k : mine) {
            for (int64_t i = starts[static_cast<size_t>(k)]; i < starts[static_cast<size_t>(k) + 1]; ++i) stream.push_back(i);
          }
          for (size_t p = 0; p < std::min(order.size(), stream.size()); ++p) {
            const auto read_at = std::find(stream.begin(), stream.end(), order[p]) - stream.begin();
            CHECK(read_at <= static_cast<std::ptrdiff_t>(p) + 4);
          }
        }
        CHECK(std::adjacent_find(lengths.begin(), lengths.end(), std::not_equal_to<>()) == lengths.end());
        CHECK(shards_seen.size() == 6);  // every shard with samples, the empty one nowhere
        if (!drop_last) CHECK(static_cast<int64_t>(seen.size()) == total);  // each sample once, padding aside
      }
    }
  }
  ShardSampler a(starts, 0, 2, {.seed = 1, .buffer = 3}), b(starts, 0, 2, {.seed = 1, .buffer = 3});
  a.set_epoch(4);
  b.set_epoch(4);
  CHECK(a.indices() == b.indices());
  b.set_epoch(5);
  CHECK(a.indices() != b.indices());
  ShardSampler ordered(starts, 0, 1, {.shuffle = false});
  std::vector<int64_t> all(static_cast<size_t>(total));
  std::iota(all.begin(), all.end(), 0);
  CHECK(ordered.indices() == all);
  CHECK_THAT(error_of<InvalidArgument>([&] { ShardSampler(starts, 0, 7, {}); }),
             Contains("6 shard(s) with samples for 7 ranks") && Contains("mtrain-pack --shard-size"));
}

TEST_CASE("ShardSampler: an epoch begun in 2 worlds ends in a third with each sample once", "[elastic]") {
  const std::vector<int64_t> starts = {0, 9, 14, 25, 31, 40, 47, 60};  // 7 shards, 60 samples
  const ShardSamplerOptions o{.shuffle = true, .seed = 2, .drop_last = false, .buffer = 5};
  const int64_t epoch = 3;
  // What each world's ranks took: the first `share` items of their orders in that world.
  const auto took = [&](int world, int64_t share, const std::vector<ShardSampler::EarlierWorld>& before) {
    std::vector<int64_t> items;
    for (int r = 0; r < world; ++r) {
      ShardSampler s(starts, r, world, o);
      if (!before.empty()) s.resume_epoch(epoch, before);
      s.set_epoch(epoch);
      const std::vector<int64_t> order = s.indices();
      REQUIRE(static_cast<int64_t>(order.size()) >= share);
      items.insert(items.end(), order.begin(), order.begin() + share);
    }
    return items;
  };
  const std::vector<int64_t> first = took(2, 8, {});       // 2 ranks x 8
  const std::vector<int64_t> second = took(3, 5, {{2, 16}});  // then 3 ranks x 5
  std::vector<int64_t> rest;
  std::set<int64_t> rest_shards;
  for (int r = 0; r < 2; ++r) {  // then 2 ranks for the rest
    ShardSampler s(starts, r, 2, o);
    s.resume_epoch(epoch, {{2, 16}, {3, 15}});
    s.set_epoch(epoch);
    const std::vector<int64_t> order = s.indices();
    CHECK(s.size() == static_cast<int64_t>(order.size()));
    rest.insert(rest.end(), order.begin(), order.end());
    const std::vector<int64_t> mine = s.assignment()[static_cast<size_t>(r)];
    for (const int64_t k : mine) CHECK(rest_shards.insert(k).second);
    s.set_epoch(epoch + 1);  // the next epoch is whole again
    CHECK(s.indices().size() >= 30);
  }
  std::set<int64_t> a(first.begin(), first.end()), b(second.begin(), second.end()), c(rest.begin(), rest.end());
  CHECK(a.size() == 16);
  CHECK(b.size() == 15);
  for (const int64_t i : b) CHECK(a.count(i) == 0);  // the second world took none the first had
  for (const int64_t i : c) CHECK((a.count(i) == 0 && b.count(i) == 0));
  CHECK(a.size() + b.size() + c.size() == 60);  // and the rest is all the others
  CHECK(rest.size() - c.size() <= 9);          // padding: at most a shard's worth
  CHECK_THAT(error_of<InvalidArgument>([&] { ShardSampler(starts, 0, 2, o).resume_epoch(0, {{2, 15}}); }),
             Contains("equal shares"));

  // A rest in fewer shards than ranks (one rank took 55 of the 60): four ranks take turns
  // over it, padded to 2 each, or cut to 1 each with drop_last.
  for (const bool drop_last : {false, true}) {
    ShardSamplerOptions d = o;
    d.drop_last = drop_last;
    const std::vector<int64_t> one = took(1, 55, {});
    std::set<int64_t> left;
    for (int64_t i = 0; i < 60; ++i) left.insert(i);
    for (const int64_t i : one) left.erase(i);
    REQUIRE(left.size() == 5);
    std::multiset<int64_t> rest_seen;
    for (int r = 0; r < 4; ++r) {
      ShardSampler s(starts, r, 4, d);
      s.resume_epoch(epoch, {{1, 55}});
      s.set_epoch(epoch);
      const std::vector<int64_t> order = s.indices();
      CHECK(static_cast<int64_t>(order.size()) == s.size());
      CHECK(s.size() == (drop_last ? 1 : 2));
      for (const int64_t i : order) {
        CHECK(left.count(i) == 1);
        rest_seen.insert(i);
      }
    }
    if (!drop_last) CHECK(std::set<int64_t>(rest_seen.begin(), rest_seen.end()) == left);
  }
}

TEST_CASE("streamed batches: images decoded per batch; one that does not decode is named, or left out") {
  TempDir dir;
  const fs::path shard = dir.path() / "s.tar";
  {
    TarWriter tar(shard);
    for (int i = 0; i < 4; ++i) {
      const std::string key = fmt::format("k{}", i);
      tar.add(key + ".png", i == 2 ? bytes_of("not a png at all") : png_bytes(dir, 3, 3, static_cast<uint8_t>(50 * i)));
      tar.add(key + ".cls", bytes_of("1"));
    }
    tar.finish();
  }
  std::vector<std::string> notes;
  auto set = std::make_shared<const Dataset>(load_webdataset({shard}, "w", resize_to(2, 2), 2, {}, notes));
  const auto run = [&](bool skip) {
    DataLoaderOptions o;
    o.batch_size = 4;
    o.skip_bad_images = skip;
    DataLoader loader(set, std::make_shared<ShardSampler>(set->encoded()->file_starts(), 0, 1,
                                                          ShardSamplerOptions{.shuffle = false}),
                      o);
    loader.start_epoch(0);
    std::optional<Batch> batch = loader.next();
    return std::make_pair(std::move(*batch), loader.images_left_out());
  };
  CHECK_THAT(error_of<IoError>([&] { run(false); }), Contains("s.tar: k2.png: expected a PNG or a JPEG image"));
  const auto [batch, left_out] = run(true);
  CHECK(batch.size() == 3);
  CHECK(batch.indices == std::vector<int64_t>{0, 1, 3});
  CHECK(batch.images.shape() == mtrain::Shape{3, 3, 2, 2});
  CHECK(batch.images.data<float>()[2 * 12] == Approx(150.0f / 255.0f));
  CHECK(left_out.first == 1);
  CHECK_THAT(left_out.second, Contains("k2.png"));
}

TEST_CASE("transforms: random resized crops inside the image, drawn per (seed, epoch, index); centre crops") {
  for (const auto& [h, w] : std::vector<std::pair<int64_t, int64_t>>{{375, 500}, {10, 300}, {1, 1}, {224, 224}}) {
    int differ = 0;
    for (int64_t index = 0; index < 200; ++index) {
      const CropBox b = random_resized_crop_box(3, 0, index, h, w);
      CHECK((b.top >= 0 && b.left >= 0 && b.height >= 1 && b.width >= 1));
      CHECK((b.top + b.height <= h && b.left + b.width <= w));
      const CropBox again = random_resized_crop_box(3, 0, index, h, w);
      CHECK((again.top == b.top && again.left == b.left && again.height == b.height && again.width == b.width));
      const CropBox next_epoch = random_resized_crop_box(3, 1, index, h, w);
      differ += next_epoch.top != b.top || next_epoch.height != b.height;
    }
    if (h >= 100 && w >= 100) CHECK(differ > 100);
  }
  // A 10x300 strip: no try fits an aspect in [3/4, 4/3], so the fallback: the whole height, 13 wide, centred.
  const CropBox strip = random_resized_crop_box(0, 0, 0, 10, 300);
  CHECK((strip.height == 10 && strip.width == 13 && strip.top == 0 && strip.left == (300 - 13) / 2));

  CHECK(shorter_side_size(375, 500, 256) == std::pair<int64_t, int64_t>{256, 341});
  CHECK(shorter_side_size(500, 375, 256) == std::pair<int64_t, int64_t>{341, 256});
  // Resize(4) of a 4x6 image then CenterCrop(2): the middle columns of the middle rows.
  DecodedImage ramp{4, 6, 1, {}};
  for (int64_t y = 0; y < 4; ++y) {
    for (int64_t x = 0; x < 6; ++x) ramp.pixels.push_back(static_cast<uint8_t>(10 * y + x));
  }
  std::vector<uint8_t> out(2 * 2 * 3);
  transform_to_chw(ramp, {ImageTransform::Kind::kCenterCrop, 2, 2, 4, 0}, 0, 0, 3, out.data());
  CHECK(std::vector<uint8_t>(out.begin(), out.begin() + 4) == std::vector<uint8_t>{12, 13, 22, 23});
  CHECK(std::vector<uint8_t>(out.begin() + 8, out.end()) == std::vector<uint8_t>{12, 13, 22, 23});
  // A colour pixel into one channel: PIL's convert("L").
  std::vector<uint8_t> luma(1);
  transform_to_chw(DecodedImage{1, 1, 3, {200, 100, 50}}, resize_to(1, 1), 0, 0, 1, luma.data());
  CHECK(luma[0] == (200 * 19595 + 100 * 38470 + 50 * 7471 + 0x8000) >> 16);
}

TEST_CASE("shard index files: what listing finds, read instead of the headers while the shard is unchanged") {
  TempDir dir;
  const fs::path a = dir.path() / "a.tar", b = dir.path() / "b.tar";
  write_shard(dir, a, 5, 10);
  {  // b: a sample without a label, then two good ones
    TarWriter tar(b);
    tar.add("x.png", png_bytes(dir, 4, 6, 7));
    for (const char* key : {"y", "z w"}) {  // a key with a space
      tar.add(std::string(key) + ".png", png_bytes(dir, 4, 6, 8));
      tar.add(std::string(key) + ".cls", bytes_of("2"));
    }
    tar.finish();
  }
  CHECK(shard_index_path(a) == dir.path() / "a.tar.mtrain.idx");
  std::string why;
  CHECK_FALSE(read_shard_index(a, why).has_value());
  CHECK(why.empty());  // none: not worth a note

  CHECK(write_shard_indexes({a, b}) == 7);
  for (const fs::path& shard : {a, b}) {
    const ShardContents listed = list_shard(shard);
    const std::optional<ShardContents> read = read_shard_index(shard, why);
    REQUIRE(read.has_value());
    CHECK(why.empty());
    REQUIRE(read->samples.size() == listed.samples.size());
    for (size_t k = 0; k < listed.samples.size(); ++k) {
      CHECK(read->samples[k].offset == listed.samples[k].offset);
      CHECK(read->samples[k].size == listed.samples[k].size);
      CHECK(read->samples[k].label == listed.samples[k].label);
      CHECK(read->samples[k].member == listed.samples[k].member);
    }
    CHECK(read->problems == listed.problems);
  }
  CHECK(read_shard_index(b, why)->samples.back().member == "z w.png");

  // Loading takes the index: a label changed in it (the shard untouched) is the label loaded.
  std::string text = read_text(shard_index_path(a));
  const size_t last_label = text.rfind(" 1 s0014.png");
  REQUIRE(last_label != std::string::npos);
  text[last_label + 1] = '2';
  write_text(shard_index_path(a), text);
  std::vector<std::string> notes;
  CHECK(load_webdataset({a}, "w", resize_to(4, 6), 0, {}, notes).labels() == std::vector<int64_t>{0, 1, 2, 0, 2});
  CHECK(notes.empty());
  // Its problems are the listing's: an error without --skip-bad-images, a note with it.
  CHECK_THAT(error_of<IoError>([&] { load_webdataset({b}, "w", resize_to(4, 6), 0, {}, notes); }),
             Contains("b.tar: sample x has no label (expected KEY.jpg, .jpeg or .png and KEY.cls) "
                      "(--skip-bad-images leaves such samples out)"));
  WebDatasetOptions skip;
  skip.skip_bad_samples = true;
  CHECK(load_webdataset({b}, "w", resize_to(4, 6), 0, skip, notes).size() == 2);
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0], Contains("1 problem(s) in w's shards") && Contains("b.tar: sample x has no label"));

  // A shard changed since (here only its time): its headers are listed, and a note says why.
  fs::last_write_time(a, fs::last_write_time(a) + std::chrono::seconds(5));
  CHECK_FALSE(read_shard_index(a, why).has_value());
  CHECK_THAT(why, Contains("a.tar.mtrain.idx: made for 'shard ") && Contains("', the shard is now 'shard "));
  notes.clear();
  CHECK(load_webdataset({a, b}, "w", resize_to(4, 6), 0, skip, notes).labels() ==
        std::vector<int64_t>{0, 1, 2, 0, 1, 2, 2});
  REQUIRE(notes.size() == 2);
  CHECK_THAT(notes[1], Contains("1 of w's 2 shard index file(s) not used, the shards' headers listed instead "
                                "(`mtrain-pack --index` writes them again); the first: ") &&
                           Contains("a.tar.mtrain.idx: made for"));

  // Index files that do not read are passed over the same way, each saying why.
  const auto refused = [&](const std::string& contents) {
    write_text(shard_index_path(b), contents);
    CHECK_FALSE(read_shard_index(b, why).has_value());
    return why;
  };
  const std::string good = read_text(shard_index_path(b));
  const size_t body = good.find("samples 2 problems 1\n");
  REQUIRE(body != std::string::npos);
  const std::string head = good.substr(0, body);
  CHECK_THAT(refused("v1.2 3\n0 1 2\n"), Contains("cannot read its first three lines"));
  CHECK_THAT(refused("v1.2 3\nx\ny\n"), Contains("expected 'mtrain shard index 1' first, found 'v1.2 3'"));
  CHECK_THAT(refused(head + "samples two\n"), Contains("expected 'samples N problems P' third"));
  CHECK_THAT(refused(head + "samples 99999999999 problems 0\n"), Contains("99999999999 samples: more than a shard of"));
  CHECK_THAT(refused(head + "samples 1 problems 0\n99999999 5 1 y.png\n"),
             Contains("line 4: expected 'OFFSET SIZE LABEL MEMBER' inside the shard's"));
  CHECK_THAT(refused(head + "samples 1 problems 0\n512 5 -1 y.png\n"), Contains("line 4: expected"));
  CHECK_THAT(refused(head + "samples 0 problems 2\nx\n"), Contains("ends before its 2 problem line(s)"));
  CHECK_THAT(refused(good + "more\n"), Contains("line 7: expected the end, found 'more'"));
  CHECK_THAT(refused(good.substr(0, good.size() - 3)), Contains("does not end with a newline: cut short?"));
  CHECK_THAT(refused(head + "samples 2 problems 1 and more\n"), Contains("expected 'samples N problems P' third"));
  write_text(shard_index_path(b), good);
  CHECK(read_shard_index(b, why).has_value());  // and the good one reads again
  // A shard that cannot be read fails the load, index or not, as listing it would.
  fs::remove(b);
  CHECK_THAT(error_of<IoError>([&] { read_shard_index(b, why); }), Contains("b.tar: cannot open it for reading"));
}

TEST_CASE("mtrain-pack: an image folder as shuffled shards that the index reads back with its labels") {
  TempDir dir;
  std::map<std::string, int> per_class = {{"ant", 5}, {"bee", 4}};
  for (const auto& [cls, n] : per_class) {
    for (int i = 0; i < n; ++i) {
      for (const char* split : {"train", "val"}) {
        fs::create_directories(dir.path() / "photos" / split / cls);
        mtrain::testing::write_jpeg(dir.path() / "photos" / split / cls / fmt::format("{}.v1.jpg", i), 5, 7, 3,
                                    std::vector<uint8_t>(105, static_cast<uint8_t>(cls == "ant" ? 10 : 240)));
      }
    }
  }
  const auto packed = pack_image_folder(dir.path() / "photos", dir.path() / "shards", {.shard_size = 4, .seed = 0});
  REQUIRE(packed.size() == 2);
  CHECK(packed[0].samples == 9);
  CHECK(packed[0].shards.size() == 3);  // 4 + 4 + 1
  CHECK(read_text(dir.path() / "shards" / "classes.txt") == "ant\nbee\n");
  for (const PackedSplit& split : packed) {
    for (const fs::path& shard : split.shards) {
      std::string why;
      CHECK(read_shard_index(shard, why).has_value());  // each shard's index file, current
      CHECK(why.empty());
    }
  }
  StreamedSplitsOptions o;
  o.train = o.eval = resize_to(5, 7);
  const DatasetSplits splits = load_webdataset_splits((dir.path() / "shards").string(), o);
  CHECK(splits.train.size() == 9);
  CHECK(splits.test.size() == 9);
  // Shuffled when written: not class by class; and each image kept its label.
  CHECK(splits.train.labels() != std::vector<int64_t>{0, 0, 0, 0, 0, 1, 1, 1, 1});
  std::vector<uint8_t> pixels(3 * 5 * 7);
  for (int64_t i = 0; i < splits.train.size(); ++i) {
    splits.train.read_image(i, 0, pixels.data());
    CHECK(std::abs(pixels[17] - (splits.train.label(i) == 0 ? 10 : 240)) <= 2);
  }
  write_text(dir.path() / "photos" / "train" / "ant" / "notes.txt", "x");
  CHECK_THAT(error_of<IoError>([&] { pack_image_folder(dir.path() / "photos", dir.path() / "again", {}); }),
             Contains("notes.txt: expected only images"));
  o.val_data.clear();
  o.evaluate = true;
  CHECK_THAT(error_of<InvalidArgument>([&] { load_webdataset_splits((dir.path() / "shards" / "train").string(), o); }),
             Contains("give --val-data, or --no-eval"));
}

TEST_CASE("a streamed image folder reads the images the in-memory one holds", "[imagefolder]") {
  TempDir dir;
  for (const char* split : {"train", "val"}) {
    for (int c = 0; c < 2; ++c) {
      const fs::path folder = dir.path() / "f" / split / fmt::format("c{}", c);
      fs::create_directories(folder);
      for (int i = 0; i < 3; ++i) {
        const int64_t h = 5 + 3 * i, w = 9 - i;
        std::vector<uint8_t> rgb;
        for (int64_t p = 0; p < h * w * 3; ++p) rgb.push_back(static_cast<uint8_t>((p * 37 + c * 90 + i) % 256));
        if (i == 1) {
          mtrain::testing::write_jpeg(folder / "b.jpg", h, w, 3, rgb);
        } else {
          mtrain::testing::write_png(folder / fmt::format("{}.png", i), h, w, 3, rgb);
        }
      }
    }
  }
  const DatasetSplits memory = load_image_folder_splits(dir.path() / "f", {.height = 6, .width = 7});
  StreamedSplitsOptions o;
  o.train = o.eval = resize_to(6, 7);
  const DatasetSplits streamed = load_image_folder_streamed(dir.path() / "f", o);
  for (const auto& [a, b] : {std::pair{&memory.train, &streamed.train}, {&memory.test, &streamed.test}}) {
    REQUIRE(a->size() == b->size());
    CHECK(a->shape() == b->shape());
    CHECK(a->labels() == b->labels());
    CHECK(b->class_names() == std::vector<std::string>{"c0", "c1"});
    CHECK_FALSE(b->encoded()->sharded());
    std::vector<uint8_t> pixels(static_cast<size_t>(b->shape().numel()));
    for (int64_t i = 0; i < b->size(); ++i) {
      b->read_image(i, 0, pixels.data());
      CHECK(std::equal(pixels.begin(), pixels.end(), a->image(i)));
    }
  }
}

TEST_CASE("reduced decode: a JPEG the transform shrinks decodes at a smaller scale, close to the full decode") {
  TempDir dir;
  const int64_t h = 360, w = 480;
  std::vector<uint8_t> rgb;
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      for (int c = 0; c < 3; ++c) rgb.push_back(static_cast<uint8_t>((x / 2 + y / 3 + c * 40 + (x * y / 50) % 7) % 256));
    }
  }
  mtrain::testing::write_jpeg(dir.file("a.jpg"), h, w, 3, rgb, 90);
  mtrain::testing::write_png(dir.file("a.png"), h, w, 3, rgb);
  for (const ImageTransform::Kind kind :
       {ImageTransform::Kind::kResize, ImageTransform::Kind::kCenterCrop, ImageTransform::Kind::kRandomResizedCrop}) {
    ImageTransform t{kind, 32, 32, 36, 9};
    for (const std::string file : {"a.jpg", "a.png"}) {
      const std::string bytes = read_text(dir.file(file));
      const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
      std::vector<uint8_t> full(3 * 32 * 32), reduced(3 * 32 * 32);
      for (int64_t index = 0; index < 4; ++index) {
        t.reduced_decode = false;
        decode_to_chw(file, data, bytes.size(), t, 0, index, 3, full.data());
        t.reduced_decode = true;
        decode_to_chw(file, data, bytes.size(), t, 0, index, 3, reduced.data());
        double error = 0;
        for (size_t k = 0; k < full.size(); ++k) error += std::abs(full[k] - reduced[k]);
        INFO(file << ", " << t.describe() << ", image " << index << ": mean |full - reduced| " << error / full.size());
        CHECK(error / static_cast<double>(full.size()) < 3.0);
        if (file == "a.png") CHECK(full == reduced);  // only JPEGs have a scaled decode
        if (file == "a.jpg") CHECK(full != reduced);  // decoded smaller: not the same bytes
      }
    }
  }
}

// Note [Decoding a crop's region]: a crop's box decoded alone (libjpeg's API, rows skipped,
// columns cropped) gives the bytes of a full decode then a crop, for every subsampling a
// camera writes and for gray, over 120 boxes RandomResizedCrop draws (of every size; the
// large ones reach the image's edges).
TEST_CASE("a crop's region decoded alone gives the full decode's bytes, boxes anywhere") {
  const int64_t h = 150, w = 203;
  std::vector<uint8_t> rgb;
  uint32_t state = 7;
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < w; ++x) {
      state = state * 1664525u + 1013904223u;
      for (int c = 0; c < 3; ++c) {
        rgb.push_back(static_cast<uint8_t>((x * (c + 1) + y * 2 + static_cast<int64_t>((state >> (8 * c)) % 40)) % 256));
      }
    }
  }
  std::vector<uint8_t> gray(rgb.size() / 3);
  for (size_t p = 0; p < gray.size(); ++p) gray[p] = rgb[3 * p + 1];
  TempDir dir;
  int compared = 0;
  for (const int subsampling : {TJSAMP_420, TJSAMP_422, TJSAMP_444, TJSAMP_GRAY}) {
    const bool is_gray = subsampling == TJSAMP_GRAY;
    const fs::path path = dir.file(fmt::format("s{}.jpg", subsampling));
    mtrain::testing::write_jpeg(path, h, w, is_gray ? 1 : 3, is_gray ? gray : rgb, 92, subsampling);
    const std::string bytes = read_text(path);
    const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
    const DecodedImage full = decode_image(path);
    // A box of the transform's own size is taken as it is; others are resized to 24 x 24.
    const ImageTransform t{ImageTransform::Kind::kRandomResizedCrop, 24, 24, 0, 5};
    for (int64_t index = 0; index < 60; ++index) {
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        std::vector<uint8_t> alone(3 * 24 * 24), whole(3 * 24 * 24);
        decode_to_chw(path.string(), data, bytes.size(), t, epoch, index, 3, alone.data());
        transform_to_chw(full, t, epoch, index, 3, whole.data());
        const CropBox box = random_resized_crop_box(t.seed, epoch, index, h, w);
        INFO(fmt::format("subsampling {}, box {}x{} at ({}, {})", subsampling, box.height, box.width, box.top, box.left));
        CHECK(alone == whole);
        ++compared;
      }
    }
  }
  CHECK(compared == 480);
}

namespace {

// A JPEG whose colour is sampled in a layout TurboJPEG has no name for (Cb at a quarter of
// the luma's resolution, Cr at half its width only), written through libjpeg's API, in
// successive scans when `progressive`. Pillow reads such files, so every decoding path must
// too.
std::vector<uint8_t> odd_sampling_jpeg(int height, int width, bool progressive) {
  jpeg_compress_struct c{};
  jpeg_error_mgr errors{};
  c.err = jpeg_std_error(&errors);
  jpeg_create_compress(&c);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buffer, &size);
  c.image_width = static_cast<JDIMENSION>(width);
  c.image_height = static_cast<JDIMENSION>(height);
  c.input_components = 3;
  c.in_color_space = JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, 90, TRUE);
  c.comp_info[0].h_samp_factor = 2;
  c.comp_info[0].v_samp_factor = 2;
  c.comp_info[1].h_samp_factor = 1;
  c.comp_info[1].v_samp_factor = 1;
  c.comp_info[2].h_samp_factor = 1;
  c.comp_info[2].v_samp_factor = 2;
  if (progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  std::vector<uint8_t> row(static_cast<size_t>(width) * 3);
  while (c.next_scanline < c.image_height) {
    const int y = static_cast<int>(c.next_scanline);
    for (int x = 0; x < width; ++x) {
      for (int k = 0; k < 3; ++k) row[static_cast<size_t>(x * 3 + k)] = static_cast<uint8_t>((x * (k + 2) + y * 3) % 256);
    }
    JSAMPROW rows[1] = {row.data()};
    jpeg_write_scanlines(&c, rows, 1);
  }
  jpeg_finish_compress(&c);
  std::vector<uint8_t> bytes(buffer, buffer + size);
  free(buffer);
  jpeg_destroy_compress(&c);
  return bytes;
}

}  // namespace

TEST_CASE("a JPEG in any sampling layout, progressive or not, decodes on every path, a crop's region as the whole") {
  const bool progressive = GENERATE(false, true);
  const std::vector<uint8_t> bytes = odd_sampling_jpeg(90, 130, progressive);
  INFO((progressive ? "progressive" : "baseline"));
  const DecodedImage whole = decode_image("odd.jpg", bytes.data(), bytes.size());
  CHECK(whole.height == 90);
  CHECK(whole.width == 130);
  CHECK(whole.channels == 3);
  for (const ImageTransform::Kind kind : {ImageTransform::Kind::kRandomResizedCrop, ImageTransform::Kind::kCenterCrop}) {
    for (const bool reduced : {false, true}) {
      ImageTransform t{kind, 20, 20, 24, 3};
      t.reduced_decode = reduced;
      for (int64_t index = 0; index < 12; ++index) {
        std::vector<uint8_t> streamed(3 * 20 * 20), in_memory(3 * 20 * 20);
        decode_to_chw("odd.jpg", bytes.data(), bytes.size(), t, 0, index, 3, streamed.data());
        transform_to_chw(whole, t, 0, index, 3, in_memory.data());
        INFO(t.describe() << ", image " << index);
        if (!reduced) CHECK(streamed == in_memory);  // reduced: decoded smaller, not the same bytes
      }
    }
  }
}
