#include "trainer/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/text.h"

namespace mtrain {

// Note [safetensors layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
//   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8+N)      a JSON object, padded with spaces to a multiple of 8 bytes:
//                         "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}
//                         "__metadata__": {"<key>": "<string value>", ...}   (optional)
//   bytes [8+N, end)    the data section; tensor <name> is bytes [b, e) of it, raw
//                       little-endian, row-major. The tensors tile the data section
//                       exactly: no gaps, no overlaps, nothing after the last one.
// What mtrain adds lives in `__metadata__` (values must be strings there):
//   "format": "pt"                  so Hugging Face tools pick the torch loader;
//   "mtrain.format_version": "1"    to be bumped if what mtrain stores changes meaning;
//   "mtrain.crc32": "<8 hex digits>" zlib CRC-32 of the whole data section. A file
//                                   without it (e.g. written by PyTorch) is accepted;
//                                   a file with a wrong one is rejected.
//   "mtrain.header_crc32"           the rest of the header (Note [Header checksum]).
//
// Note [Atomic writes]
// ~~~~~~~~~~~~~~~~~~~~
// A crash, a full disk or a kill in the middle of a save must never leave a half-written file
// under the target name (the previous checkpoint is worth more than a torn new one).
// save_safetensors writes a temporary file in the target's directory (same filesystem, so the
// rename is atomic), fsyncs it, renames it over the target and fsyncs the directory so the rename
// itself survives a power cut. On any failure the temporary file is removed and the target is
// left as it was.

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host needs byte swapping here");

std::string temporary_file_prefix(const std::string& path) {
  return "." + std::filesystem::path(path).filename().string() + ".tmp-";
}

namespace {

// The upstream reader refuses larger headers; so do we, which also bounds what a
// corrupt length field can make us allocate.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::Float32, "F32"}, {DType::BFloat16, "BF16"}, {DType::Float16, "F16"},
    {DType::Int64, "I64"},   {DType::Int32, "I32"},     {DType::UInt8, "U8"},
};
// Valid safetensors dtypes that mtrain's Tensor cannot hold.
constexpr const char* kUnsupportedDTypes[] = {"F64", "I8", "I16", "U16", "U32", "U64", "BOOL",
                                              "F8_E4M3", "F8_E5M2"};

std::string errno_text() { return std::strerror(errno); }

// Extends a zlib CRC-32 by `size` bytes (zlib takes 32-bit lengths, tensors may not fit).
uLong crc32_update(uLong crc, const void* data, size_t size) {
  const auto* p = static_cast<const Bytef*>(data);
  while (size > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(size, 1u << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    size -= chunk;
  }
  return crc;
}

std::string crc32_to_hex(uLong crc) { return fmt::format("{:08x}", static_cast<uint32_t>(crc)); }

// ---- writing -----------------------------------------------------------------------

// Owns a file descriptor; closes it on scope exit unless released.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  // Closes now so that the error of close() (delayed write errors on NFS) is seen.
  int close_checked() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

void write_all(int fd, const void* data, size_t size, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("writing {}: {}", what, errno_text()));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

std::string temp_path_for(const std::filesystem::path& target) {
  static std::atomic<uint64_t> counter{0};
  const std::string name = fmt::format("{}{}-{}", temporary_file_prefix(target.string()), ::getpid(),
                                       counter.fetch_add(1));
  return (target.parent_path() / name).string();
}

void fsync_directory(const std::filesystem::path& dir, const std::string& target) {
  const std::string d = dir.empty() ? "." : dir.string();
  FileDescriptor fd(::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    throw IoError(fmt::format("saving {}: cannot open directory {} to sync it: {}", target, d,
                              errno_text()));
  }
  if (::fsync(fd.get()) != 0) {
    throw IoError(fmt::format("saving {}: fsync of directory {} failed: {}", target, d,
                              errno_text()));
  }
}

void check_tensors_to_save(const NamedTensors& tensors, const std::string& path) {
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty() || name == kMetadataKey) {
      throw InvalidArgument(fmt::format("saving {}: invalid tensor name '{}'", path, name));
    }
    if (!seen.insert(name).second) {
      throw InvalidArgument(fmt::format("saving {}: tensor name '{}' appears twice", path, name));
    }
    if (!t.defined()) {
      throw InvalidArgument(fmt::format("saving {}: tensor '{}' is undefined", path, name));
    }
    if (!t.device().is_cpu()) {
      throw InvalidArgument(fmt::format("saving {}: tensor '{}' lives on {}; copy it to the CPU first",
                                        path, name, t.device().str()));
    }
  }
}

// ---- reading -----------------------------------------------------------------------

struct HeaderEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// `problem` may quote the file's own bytes (a parser's "last read: ...", a name, a
// dumped value), which are neither text nor short.
[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw IoError(fmt::format("safetensors file {}: {}", path, printable_text(problem, 1000)));
}

uint64_t read_u64_le(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

void read_exact(std::FILE* f, void* data, size_t size, const std::string& path, const char* what) {
  if (size == 0) return;
  if (std::fread(data, 1, size, f) != size) {
    if (std::ferror(f)) fail(path, fmt::format("reading {}: {}", what, errno_text()));
    fail(path, fmt::format("file ended while reading {}", what));
  }
}

uint64_t json_to_u64(const nlohmann::json& v, const std::string& path, const std::string& what) {
  if (!v.is_number_unsigned()) {
    fail(path, fmt::format("{}: expected a non-negative integer, found {}", what, v.dump()));
  }
  return v.get<uint64_t>();
}

HeaderEntry parse_entry(const std::string& name, const nlohmann::json& info, const std::string& path) {
  if (!info.is_object()) {
    fail(path, fmt::format("tensor '{}': expected an object with dtype, shape and data_offsets, "
                           "found {}", name, info.dump()));
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(key)) fail(path, fmt::format("tensor '{}': missing \"{}\"", name, key));
  }
  HeaderEntry e;
  e.name = name;
  const auto& dtype = info["dtype"];
  if (!dtype.is_string()) {
    fail(path, fmt::format("tensor '{}': dtype must be a string, found {}", name, dtype.dump()));
  }
  e.dtype = parse_safetensors_dtype(dtype.get<std::string>(), path);

  const auto& shape = info["shape"];
  if (!shape.is_array()) {
    fail(path, fmt::format("tensor '{}': shape must be an array, found {}", name, shape.dump()));
  }
  uint64_t numel = 1;
  for (const auto& d : shape) {
    const uint64_t dim = json_to_u64(d, path, fmt::format("tensor '{}' shape", name));
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / dim)) {
      fail(path, fmt::format("tensor '{}': shape {} overflows", name, shape.dump()));
    }
    numel *= dim;
    e.shape.push_back(static_cast<int64_t>(dim));
  }

  const auto& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    fail(path, fmt::format("tensor '{}': data_offsets must be [begin, end], found {}", name,
                           offsets.dump()));
  }
  e.begin = json_to_u64(offsets[0], path, fmt::format("tensor '{}' data_offsets", name));
  e.end = json_to_u64(offsets[1], path, fmt::format("tensor '{}' data_offsets", name));
  if (e.end < e.begin) {
    fail(path, fmt::format("tensor '{}': data_offsets [{}, {}] end before begin", name, e.begin,
                           e.end));
  }
  const uint64_t elem = dtype_size(e.dtype);
  if (numel > std::numeric_limits<uint64_t>::max() / elem || e.end - e.begin != numel * elem) {
    fail(path, fmt::format("tensor '{}': {} of shape {} needs {} bytes but data_offsets [{}, {}] "
                           "span {}", name, dtype.get<std::string>(), shape_str(e.shape),
                           numel * elem, e.begin, e.end, e.end - e.begin));
  }
  return e;
}

// Parses the header JSON, rejecting duplicate top-level names (nlohmann would keep
// the last silently, and the first tensor's bytes would then pass for a gap).
nlohmann::json parse_header_json(const std::string& text, const std::string& path) {
  std::string duplicate;
  std::set<std::string> names;
  const nlohmann::json::parser_callback_t track = [&](int depth, nlohmann::json::parse_event_t event,
                                                       nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && duplicate.empty()) {
      const auto name = parsed.get<std::string>();
      if (!names.insert(name).second) duplicate = name;
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, track);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, and out_of_range for a number no double holds (e.g. 1e999).
    fail(path, fmt::format("header is not valid JSON ({})", e.what()));
  }
  if (!duplicate.empty()) fail(path, fmt::format("header names '{}' twice", duplicate));
  if (!header.is_object()) {
    fail(path, fmt::format("header must be a JSON object, found a {}", header.type_name()));
  }
  return header;
}

SafetensorsMetadata parse_metadata(const nlohmann::json& meta, const std::string& path) {
  if (!meta.is_object()) {
    fail(path, fmt::format("__metadata__ must be an object, found {}", meta.dump()));
  }
  SafetensorsMetadata out;
  for (const auto& [key, value] : meta.items()) {
    if (!value.is_string()) {
      fail(path, fmt::format("__metadata__ value for '{}' must be a string, found {}", key,
                             value.dump()));
    }
    out[key] = value.get<std::string>();
  }
  return out;
}

// Orders entries by offset and checks they tile [0, data_size) exactly.
void check_layout(std::vector<HeaderEntry>& entries, uint64_t data_size, const std::string& path) {
  std::stable_sort(entries.begin(), entries.end(), [](const HeaderEntry& a, const HeaderEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  const HeaderEntry* previous = nullptr;
  for (const auto& e : entries) {
    if (e.begin < expected) {
      fail(path, fmt::format("tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))",
                             e.name, e.begin, e.end, previous->name, previous->begin, previous->end));
    }
    if (e.begin > expected) {
      fail(path, fmt::format("bytes [{}, {}) of the data section belong to no tensor (next is '{}')",
                             expected, e.begin, e.name));
    }
    expected = e.end;
    previous = &e;
  }
  if (expected != data_size) {
    if (expected > data_size) {
      fail(path, fmt::format("truncated: the header describes {} data bytes but the file holds {}",
                             expected, data_size));
    }
    fail(path, fmt::format("{} bytes after the last tensor belong to no tensor",
                           data_size - expected));
  }
}

}  // namespace

void rename_durably(const std::string& from, const std::string& to) {
  std::error_code ec;
  std::filesystem::rename(from, to, ec);
  if (ec) throw IoError(fmt::format("cannot rename {} to {}: {}", from, to, ec.message()));
  fsync_directory(std::filesystem::path(to).parent_path(), to);
}

Tensor SafetensorsFile::find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return t;
  }
  return Tensor();
}

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& d : kDTypeNames) {
    if (d.dtype == dtype) return d.name;
  }
  throw InvalidArgument(fmt::format("dtype {} has no safetensors name", dtype_name(dtype)));
}

DType parse_safetensors_dtype(const std::string& name, const std::string& file) {
  for (const auto& d : kDTypeNames) {
    if (name == d.name) return d.dtype;
  }
  std::vector<std::string> known;
  for (const auto& d : kDTypeNames) known.emplace_back(d.name);
  for (const char* u : kUnsupportedDTypes) {
    if (name == u) {
      fail(file, fmt::format("dtype {} is valid safetensors but mtrain cannot hold it "
                             "(supported: {})", name, fmt::join(known, ", ")));
    }
  }
  fail(file, fmt::format("unknown dtype '{}' (supported: {})", name, fmt::join(known, ", ")));
}

std::string crc32_hex(const void* data, size_t size) {
  return crc32_to_hex(crc32_update(::crc32(0L, Z_NULL, 0), data, size));
}

// Note [Header checksum]: CRC-32 of the header's content in a canonical form, so that it
// does not depend on JSON spelling or key order: every metadata entry but this checksum
// itself as "key=value" lines in key order, then every tensor as "name dtype shape
// begin end" lines in data order. mtrain.crc32 covers only the data section, and a
// training checkpoint's position (epoch, step, loss scale) and configuration live in
// the metadata: a flipped digit there would resume at the wrong step.
std::string header_crc32(const SafetensorsMetadata& metadata, const std::vector<HeaderEntry>& entries) {
  std::string text;
  for (const auto& [k, v] : metadata) {
    if (k != kSafetensorsHeaderChecksumKey) text += fmt::format("{}={}\n", k, v);
  }
  for (const auto& e : entries) {
    text += fmt::format("{} {} {} {} {}\n", e.name, safetensors_dtype_name(e.dtype), shape_str(e.shape), e.begin,
                        e.end);
  }
  return crc32_hex(text.data(), text.size());
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const SafetensorsMetadata& metadata) {
  check_tensors_to_save(tensors, path);

  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (const auto& [name, t] : tensors) crc = crc32_update(crc, t.raw_data(), t.nbytes());

  SafetensorsMetadata all = metadata;
  all["format"] = "pt";
  all[kSafetensorsVersionKey] = kSafetensorsFormatVersion;
  all[kSafetensorsChecksumKey] = crc32_to_hex(crc);
  all.erase(kSafetensorsHeaderChecksumKey);
  std::vector<HeaderEntry> entries;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    entries.push_back({name, t.dtype(), t.shape(), offset, offset + t.nbytes()});
    offset += t.nbytes();
  }
  const std::string header_crc = header_crc32(all, entries);

  // Metadata first (the caller's keys, then mtrain's), then tensors in data order, so
  // the header reads top-down.
  nlohmann::ordered_json header;
  auto& meta = header[kMetadataKey] = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) {
    if (k != kSafetensorsHeaderChecksumKey) meta[k] = v;
  }
  meta["format"] = "pt";
  meta[kSafetensorsVersionKey] = kSafetensorsFormatVersion;
  meta[kSafetensorsChecksumKey] = all[kSafetensorsChecksumKey];
  meta[kSafetensorsHeaderChecksumKey] = header_crc;
  for (const auto& e : entries) {
    header[e.name] = {{"dtype", safetensors_dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // upstream pads so the data is 8-aligned

  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  const std::filesystem::path target(path);
  // The file is renamed over the target: a device or FIFO there (--save-final /dev/null)
  // would be replaced by a regular file, which as root destroys the node.
  if (const auto kind = non_regular_file_kind(path)) {
    throw IoError(fmt::format("saving {}: expected a regular file or a new name, found {}", path, *kind));
  }
  const std::string temp = temp_path_for(target);
  FileDescriptor fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
  if (fd.get() < 0) {
    throw IoError(fmt::format("saving {}: cannot create {}: {}", path, temp, errno_text()));
  }
  try {
    const std::string what = fmt::format("{} (temporary file for {})", temp, path);
    write_all(fd.get(), length, sizeof length, what);
    write_all(fd.get(), text.data(), text.size(), what);
    for (const auto& [name, t] : tensors) write_all(fd.get(), t.raw_data(), t.nbytes(), what);
    if (::fsync(fd.get()) != 0) throw IoError(fmt::format("fsync of {}: {}", what, errno_text()));
    if (fd.close_checked() != 0) throw IoError(fmt::format("closing {}: {}", what, errno_text()));
    if (::rename(temp.c_str(), path.c_str()) != 0) {
      throw IoError(fmt::format("saving {}: renaming {} over it failed: {}", path, temp, errno_text()));
    }
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  fsync_directory(target.parent_path(), path);
}

std::optional<std::string> non_regular_file_kind(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return std::nullopt;
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return "not a regular file";
}

SafetensorsFile load_safetensors(const std::string& path) {
  // Before opening: opening a FIFO for reading blocks until someone writes to it.
  if (const auto kind = non_regular_file_kind(path)) fail(path, fmt::format("expected a regular file, found {}", *kind));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw IoError(fmt::format("cannot open safetensors file {}: {}", path, errno_text()));
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(f, &std::fclose);

  struct stat st {};
  if (::fstat(::fileno(f), &st) != 0) fail(path, fmt::format("stat failed: {}", errno_text()));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    fail(path, fmt::format("{} bytes long; a safetensors file starts with an 8-byte header length",
                           file_size));
  }
  unsigned char length_bytes[8];
  read_exact(f, length_bytes, 8, path, "the header length");
  const uint64_t header_size = read_u64_le(length_bytes);
  if (header_size > file_size - 8) {
    fail(path, fmt::format("header length {} exceeds the {} bytes after the length field "
                           "(truncated file, or not safetensors)", header_size, file_size - 8));
  }
  if (header_size > kMaxHeaderBytes) {
    fail(path, fmt::format("header length {} exceeds the limit of {} bytes", header_size,
                           kMaxHeaderBytes));
  }
  if (header_size < 2) fail(path, fmt::format("header length {} is too short for a JSON object", header_size));
  std::string text(header_size, '\0');
  read_exact(f, text.data(), header_size, path, "the header");

  const nlohmann::json header = parse_header_json(text, path);
  SafetensorsFile out;
  std::vector<HeaderEntry> entries;
  for (const auto& [name, info] : header.items()) {
    if (name == kMetadataKey) {
      out.metadata = parse_metadata(info, path);
    } else {
      entries.push_back(parse_entry(name, info, path));
    }
  }
  const uint64_t data_size = file_size - 8 - header_size;
  check_layout(entries, data_size, path);
  // Files written before the header checksum, and by other programs, have none.
  if (const auto stored = out.metadata.find(kSafetensorsHeaderChecksumKey); stored != out.metadata.end()) {
    const std::string actual = header_crc32(out.metadata, entries);
    if (stored->second != actual) {
      fail(path, fmt::format("header checksum mismatch: {} says {}, the header has {} (the file is corrupt)",
                             kSafetensorsHeaderChecksumKey, stored->second, actual));
    }
  }

  // The entries now tile the data section in order, so one sequential read fills them.
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (const auto& e : entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    read_exact(f, t.raw_data(), t.nbytes(), path, fmt::format("tensor '{}'", e.name).c_str());
    crc = crc32_update(crc, t.raw_data(), t.nbytes());
    out.tensors.emplace_back(e.name, std::move(t));
  }
  const auto stored = out.metadata.find(kSafetensorsChecksumKey);
  if (stored != out.metadata.end()) {
    const std::string actual = crc32_to_hex(crc);
    if (stored->second != actual) {
      fail(path, fmt::format("checksum mismatch: {} says {}, the data section has {} "
                             "(the file is corrupt)", kSafetensorsChecksumKey, stored->second, actual));
    }
  }
  return out;
}

}  // namespace mtrain
