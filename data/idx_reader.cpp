#include "data/idx_reader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>

#include <algorithm>
#include <array>

#include "core/error.h"

// Note [IDX validation]
// ~~~~~~~~~~~~~~~~~~~~~
// IDX is a big-endian header followed by raw bytes: images are magic 0x00000803 (uint8, 3 dims),
// item count, rows, cols; labels are magic 0x00000801 (uint8, 1 dim), item count. Whether a file
// is gzip is decided by its first two bytes (1f 8b), never by its name, because people gunzip
// files and keep the name or the other way round. A file is accepted only if the payload is
// exactly what the header promises: fewer bytes is "truncated", more is "trailing bytes", so a
// half-downloaded or concatenated file fails loudly instead of training on garbage. (Bytes after a
// complete gzip stream that are not another gzip member are skipped by zlib's gzread, as gunzip
// warns about and skips them; the payload they follow is whole.) A gzip stream must also reach its
// 8-byte trailer, whose CRC is the only check that the data arrived intact: one that stops after
// the payload is "truncated" too. Dimensions are read from the header (28x28 for these datasets)
// but must be in [1, kMaxIdxSide]; labels must be in [0, num_classes). Memory grows with the bytes
// actually read, so a header that lies about its count cannot make the reader allocate gigabytes.
// Every error is an IoError naming the file, what was expected and what was found.

namespace mtrain::data {
namespace {

// Sequential reader over a gzip or raw file (zlib's gz* API tells them apart by the
// gzip magic and reads raw files directly). Errors name the file.
class ByteReader {
 public:
  explicit ByteReader(const std::filesystem::path& path) : path_(path.string()) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {
      throw IoError(fmt::format("IDX file {}: expected a regular file, found {}", path_,
                                std::filesystem::exists(path, ec) ? "something else"
                                                                  : "nothing (no such file)"));
    }
    file_ = gzopen(path_.c_str(), "rb");
    if (file_ == nullptr) {
      throw IoError(fmt::format("IDX file {}: cannot open it for reading", path_));
    }
    gzbuffer(file_, 1 << 17);
  }
  ~ByteReader() {
    if (file_ != nullptr) gzclose(file_);
  }
  ByteReader(const ByteReader&) = delete;
  ByteReader& operator=(const ByteReader&) = delete;

  // Reads up to `n` bytes; returns how many were read (fewer only at the end of data).
  size_t read(uint8_t* out, size_t n) {
    size_t total = 0;
    while (total < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - total, 1u << 30));
      const int got = gzread(file_, out + total, chunk);
      if (got < 0) {
        int code = Z_OK;
        const char* message = gzerror(file_, &code);
        throw IoError(fmt::format("IDX file {}: corrupt gzip data after {} decompressed bytes ({})",
                                  path_, offset_ + total, message));
      }
      if (got == 0) break;
      total += static_cast<size_t>(got);
    }
    offset_ += total;
    if (total < n && stream_cut_short()) cut_short_ = true;
    return total;
  }

  // Counts (and discards) the bytes left; 0 means the file ended exactly here.
  uint64_t count_remaining() {
    std::array<uint8_t, 1 << 16> sink{};
    uint64_t extra = 0;
    for (;;) {
      const size_t got = read(sink.data(), sink.size());
      extra += got;
      if (got < sink.size()) return extra;
    }
  }

  const std::string& path() const { return path_; }
  const char* format() const { return gzdirect(file_) ? "raw" : "gzip"; }
  // Whether the gzip stream stopped before its end: in its data, or before the 8-byte
  // trailer that holds the CRC (the only check on the data's integrity).
  bool cut_short() const { return cut_short_; }
  // Why the data ended early, for "truncated" messages: a gzip stream that stops in
  // the middle is a cut-off download, which is worth saying.
  std::string cut_short_note() const {
    return cut_short_ ? " (the gzip stream itself is cut off: incomplete download?)" : "";
  }

 private:
  bool stream_cut_short() {
    int code = Z_OK;
    gzerror(file_, &code);
    return code == Z_BUF_ERROR;
  }

  std::string path_;
  gzFile file_ = nullptr;
  uint64_t offset_ = 0;  // decompressed bytes read so far
  bool cut_short_ = false;
};

uint32_t big_endian_u32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string describe_magic(uint32_t magic) {
  if (magic == kIdxImagesMagic) return "0x00000803 (an images file)";
  if (magic == kIdxLabelsMagic) return "0x00000801 (a labels file)";
  return fmt::format("0x{:08x} (not an IDX uint8 file)", magic);
}

// Reads the header words; a file shorter than its header is "truncated". The magic is
// checked as soon as it is read, so a short file of the wrong kind (a labels file given
// as images) is reported as the wrong kind, not as truncated.
std::vector<uint32_t> read_header(ByteReader& in, size_t words, uint32_t expected_magic,
                                  const char* kind) {
  std::vector<uint8_t> raw(words * 4);
  size_t got = in.read(raw.data(), 4);
  if (got == 4 && big_endian_u32(raw.data()) != expected_magic) {
    throw IoError(fmt::format("IDX file {}: expected magic 0x{:08x} ({}), found {}", in.path(),
                              expected_magic, kind, describe_magic(big_endian_u32(raw.data()))));
  }
  if (got == 4) got += in.read(raw.data() + 4, raw.size() - 4);
  if (got < raw.size()) {
    throw IoError(fmt::format("IDX file {}: truncated: expected a {}-byte {} header, found only {} "
                              "bytes{}",
                              in.path(), raw.size(), kind, got, in.cut_short_note()));
  }
  std::vector<uint32_t> header(words);
  for (size_t i = 0; i < words; ++i) header[i] = big_endian_u32(raw.data() + 4 * i);
  if (header[1] == 0 || header[1] > kMaxIdxItems) {
    throw IoError(fmt::format("IDX file {}: expected an item count in [1, {}], found {}",
                              in.path(), kMaxIdxItems, header[1]));
  }
  return header;
}

// Reads exactly `bytes` payload bytes, growing the buffer only as data arrives, then
// insists that nothing follows.
std::vector<uint8_t> read_payload(ByteReader& in, uint64_t bytes, const std::string& promise) {
  constexpr uint64_t kChunk = 4u << 20;
  std::vector<uint8_t> payload;
  while (payload.size() < bytes) {
    const size_t old_size = payload.size();
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(kChunk, bytes - old_size));
    payload.resize(old_size + chunk);
    const size_t got = in.read(payload.data() + old_size, chunk);
    if (got < chunk) {
      throw IoError(fmt::format(
          "IDX file {}: truncated: the header promises {} ({} bytes after the header), found "
          "only {} bytes{}",
          in.path(), promise, bytes, old_size + got, in.cut_short_note()));
    }
  }
  const uint64_t extra = in.count_remaining();
  // Every promised byte arrived, but a gzip stream cut off before its trailer was never
  // checked against its CRC: a download that is both short and corrupt would load.
  if (in.cut_short()) {
    throw IoError(fmt::format(
        "IDX file {}: truncated: the gzip stream ends before its 8-byte CRC and length trailer, "
        "so its data cannot be verified (incomplete download?)",
        in.path()));
  }
  if (extra != 0) {
    throw IoError(fmt::format(
        "IDX file {}: trailing bytes: the header promises {} ({} bytes after the header), found "
        "{} bytes ({} extra)",
        in.path(), promise, bytes, bytes + extra, extra));
  }
  return payload;
}

}  // namespace

IdxImages read_idx_images(const std::filesystem::path& path) {
  ByteReader in(path);
  const std::vector<uint32_t> header = read_header(in, 4, kIdxImagesMagic, "images");
  IdxImages images;
  images.count = header[1];
  images.rows = header[2];
  images.cols = header[3];
  if (images.rows < 1 || images.rows > kMaxIdxSide || images.cols < 1 ||
      images.cols > kMaxIdxSide) {
    throw IoError(fmt::format(
        "IDX file {}: expected image dimensions in [1, {}] (28x28 for MNIST), found {}x{}",
        in.path(), kMaxIdxSide, images.rows, images.cols));
  }
  const uint64_t bytes = static_cast<uint64_t>(images.count) * images.rows * images.cols;
  images.pixels = read_payload(
      in, bytes, fmt::format("{} images of {}x{}", images.count, images.rows, images.cols));
  return images;
}

std::vector<int64_t> read_idx_labels(const std::filesystem::path& path, int64_t num_classes) {
  ByteReader in(path);
  const std::vector<uint32_t> header = read_header(in, 2, kIdxLabelsMagic, "labels");
  const std::vector<uint8_t> raw =
      read_payload(in, header[1], fmt::format("{} labels", header[1]));
  std::vector<int64_t> labels(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] >= num_classes) {
      throw IoError(fmt::format("IDX file {}: label of item {} is {}, expected [0, {}]",
                                in.path(), i, raw[i], num_classes - 1));
    }
    labels[i] = raw[i];
  }
  return labels;
}

Dataset load_idx_dataset(const std::filesystem::path& images_path,
                         const std::filesystem::path& labels_path, const std::string& name,
                         int64_t num_classes) {
  IdxImages images = read_idx_images(images_path);
  std::vector<int64_t> labels = read_idx_labels(labels_path, num_classes);
  if (static_cast<int64_t>(labels.size()) != images.count) {
    throw IoError(fmt::format(
        "IDX files do not match: expected as many labels as images, found {} images in {} and "
        "{} labels in {}",
        images.count, images_path.string(), labels.size(), labels_path.string()));
  }
  std::string origin = fmt::format("IDX {}", images_path.parent_path().string());
  return Dataset(name, std::move(origin), ImageShape{1, images.rows, images.cols}, num_classes,
                 std::move(images.pixels), std::move(labels));
}

const std::vector<std::string>& idx_file_stems() {
  static const std::vector<std::string> stems = {kIdxTrainImages, kIdxTrainLabels, kIdxTestImages,
                                                 kIdxTestLabels};
  return stems;
}

std::optional<std::filesystem::path> find_idx_file(const std::filesystem::path& dir,
                                                   const std::string& stem) {
  std::error_code ec;
  for (const std::filesystem::path& candidate : {dir / (stem + ".gz"), dir / stem}) {
    if (std::filesystem::is_regular_file(candidate, ec)) return candidate;
  }
  return std::nullopt;
}

DatasetSplits load_idx_splits(const std::filesystem::path& dir, const std::string& dataset) {
  std::vector<std::filesystem::path> paths;
  std::vector<std::string> missing;
  for (const std::string& stem : idx_file_stems()) {
    if (auto found = find_idx_file(dir, stem)) {
      paths.push_back(*found);
    } else {
      missing.push_back(stem + "[.gz]");
    }
  }
  if (!missing.empty()) {
    throw IoError(fmt::format("dataset directory {}: expected the four IDX files, missing {}",
                              dir.string(), fmt::join(missing, ", ")));
  }
  constexpr int64_t kClasses = 10;
  DatasetSplits splits;
  splits.train = load_idx_dataset(paths[0], paths[1], dataset + "/train", kClasses);
  splits.test = load_idx_dataset(paths[2], paths[3], dataset + "/test", kClasses);
  return splits;
}

}  // namespace mtrain::data
