#include "data/tar.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <optional>

#include "core/error.h"

namespace mtrain::data {
namespace {

constexpr uint64_t kBlock = 512;
using Block = std::array<uint8_t, kBlock>;

uint64_t padded(uint64_t size) { return (size + kBlock - 1) / kBlock * kBlock; }

// A NUL-terminated (or full-width) text field.
std::string field(const Block& b, size_t at, size_t width) {
  const auto* begin = reinterpret_cast<const char*>(b.data() + at);
  return std::string(begin, strnlen(begin, width));
}

// An octal number field (spaces and NULs around it), or GNU's base-256 form (the high bit of
// the first byte set); nullopt when it is neither.
std::optional<uint64_t> number(const Block& b, size_t at, size_t width) {
  if ((b[at] & 0x80) != 0) {
    uint64_t v = b[at] & 0x7F;
    for (size_t i = 1; i < width; ++i) {
      if (v >> 55 != 0) return std::nullopt;
      v = v << 8 | b[at + i];
    }
    return v;
  }
  size_t i = at, end = at + width;
  while (i < end && b[i] == ' ') ++i;
  uint64_t v = 0;
  bool digits = false;
  for (; i < end && b[i] >= '0' && b[i] <= '7'; ++i) {
    if (v >> 60 != 0) return std::nullopt;
    v = v * 8 + (b[i] - '0');
    digits = true;
  }
  for (; i < end; ++i) {
    if (b[i] != ' ' && b[i] != '\0') return std::nullopt;
  }
  return digits ? std::optional<uint64_t>(v) : std::nullopt;
}

bool all_zero(const Block& b) {
  return std::all_of(b.begin(), b.end(), [](uint8_t x) { return x == 0; });
}

// The checksum: every byte of the header with the checksum field counted as spaces, summed
// as unsigned bytes (POSIX) or as signed ones (some old tars; Python's tarfile takes both).
bool checksum_matches(const Block& b) {
  const std::optional<uint64_t> stored = number(b, 148, 8);
  if (!stored) return false;
  int64_t unsigned_sum = 0, signed_sum = 0;
  for (size_t i = 0; i < kBlock; ++i) {
    const uint8_t byte = (i >= 148 && i < 156) ? uint8_t{' '} : b[i];
    unsigned_sum += byte;
    signed_sum += static_cast<int8_t>(byte);
  }
  return static_cast<int64_t>(*stored) == unsigned_sum || static_cast<int64_t>(*stored) == signed_sum;
}

// A pax extended header's "path" record, if any ("LEN path=VALUE\n" records).
std::optional<std::string> pax_path(const std::vector<uint8_t>& data) {
  std::optional<std::string> path;
  size_t at = 0;
  while (at < data.size()) {
    size_t space = at;
    uint64_t length = 0;
    while (space < data.size() && data[space] >= '0' && data[space] <= '9' && length <= data.size()) {
      length = length * 10 + (data[space++] - '0');
    }
    // A record holds its length, a space, at least one byte and its newline.
    if (space >= data.size() || data[space] != ' ' || length < space - at + 2 || length > data.size() - at) break;
    const std::string record(data.begin() + static_cast<std::ptrdiff_t>(space + 1),
                             data.begin() + static_cast<std::ptrdiff_t>(at + length));
    if (record.rfind("path=", 0) == 0 && !record.empty() && record.back() == '\n') {
      path = record.substr(5, record.size() - 6);
    }
    at += length;
  }
  return path;
}

std::string system_error() { return std::strerror(errno); }

}  // namespace

ReadOnlyFile::ReadOnlyFile(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw IoError(fmt::format("{}: cannot open it for reading: {}", path.string(), system_error()));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const std::string why = system_error();
    ::close(fd_);
    throw IoError(fmt::format("{}: cannot ask its size: {}", path.string(), why));
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

void ReadOnlyFile::expect_jumps() const {
  // Advice only: a kernel that ignores it reads ahead, which costs time, not correctness.
  (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<uint8_t> ReadOnlyFile::read(uint64_t offset, uint64_t size, const std::string& what) const {
  std::vector<uint8_t> bytes(size);
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd_, bytes.data() + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(fmt::format("{}: reading {}: {}", path_.string(), what, system_error()));
    if (n == 0) {
      throw IoError(fmt::format("{}: the file ends at byte {} inside {} (bytes {} to {})", path_.string(),
                                offset + done, what, offset, offset + size));
    }
    done += static_cast<uint64_t>(n);
  }
  return bytes;
}

// Note [Reading tar headers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tar is a chain of 512-byte headers, each followed by its member's data padded to 512
// bytes; two zero blocks end it. Listing a shard reads each header and seeks over the data,
// with the kernel's read-ahead turned off for it (a 100 KB JPEG would otherwise be read
// whole to list it): an ImageNet shard of 1 GB costs about 10,000 small reads. A header is
// trusted only when its checksum matches. GNU tar's long names ('L': the next member's name
// as data) and pax records ('x': "path=") give names longer than ustar's 255 bytes; other
// entries (directories, links, global pax records) are passed over. An archive cut short
// keeps the members before the cut (`damage` says where), so a shard copied halfway still
// lists what it holds; an archive that ends without its two zero blocks is whole, as GNU
// tar and Python's tarfile read it.
TarListing list_tar(const std::filesystem::path& path) {
  const ReadOnlyFile file(path);
  file.expect_jumps();
  TarListing listing;
  const std::string where = path.string();
  std::optional<std::string> long_name;
  uint64_t at = 0;
  while (at < file.size()) {
    if (at + kBlock > file.size()) {
      listing.damage = fmt::format("the archive ends inside a header (at byte {} of {})", at, file.size());
      break;
    }
    Block b{};
    const std::vector<uint8_t> bytes = file.read(at, kBlock, fmt::format("the header at byte {}", at));
    std::copy(bytes.begin(), bytes.end(), b.begin());
    if (all_zero(b)) break;
    const std::optional<uint64_t> size = number(b, 124, 12);
    if (!checksum_matches(b) || !size) {
      listing.damage = fmt::format("no tar header at byte {} (its checksum or size field does not read)", at);
      break;
    }
    const uint64_t data = at + kBlock;
    const char type = static_cast<char>(b[156]);
    // The prefix field is ustar's ("ustar\0"); GNU's format ("ustar  \0") keeps times there.
    const bool ustar = std::memcmp(b.data() + 257, "ustar", 6) == 0;
    std::string name = ustar ? field(b, 345, 155) : std::string();
    name = name.empty() ? field(b, 0, 100) : name + "/" + field(b, 0, 100);
    if (long_name) name = *std::move(long_name);
    long_name.reset();
    if (data + *size > file.size()) {
      listing.damage = fmt::format("the archive ends inside member {} (its {} bytes from byte {}; the file has {})",
                                   name, *size, data, file.size());
      break;
    }
    if (type == 'L' || type == 'x') {
      const std::vector<uint8_t> text = file.read(data, *size, fmt::format("the long name at byte {}", data));
      if (type == 'L') {
        long_name = std::string(text.begin(), std::find(text.begin(), text.end(), uint8_t{0}));
      } else {
        long_name = pax_path(text);
      }
    } else if (type == '0' || type == '\0' || type == '7') {
      listing.members.push_back({std::move(name), data, *size});
    }
    at = data + padded(*size);
  }
  if (listing.members.empty() && !listing.damage.empty() && at == 0) {
    throw IoError(fmt::format("{}: expected a tar archive, found {}", where, listing.damage));
  }
  return listing;
}

TarWriter::TarWriter(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError(fmt::format("{}: cannot create it: {}", path.string(), system_error()));
}

TarWriter::~TarWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TarWriter::write(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd_, p + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(fmt::format("{}: writing: {}", path_.string(), system_error()));
    done += static_cast<size_t>(n);
  }
  written_ += size;
}

void TarWriter::add(const std::string& name, const std::vector<uint8_t>& bytes) {
  // ustar keeps a name of up to 100 bytes, or a prefix of up to 155 and a name of up to 100
  // split at a '/'.
  std::string prefix, rest = name;
  if (name.size() > 100) {
    const size_t slash = name.rfind('/', 155);
    if (slash == std::string::npos || name.size() - slash - 1 > 100 || slash == 0) {
      throw InvalidArgument(fmt::format("{}: a ustar archive cannot hold the member name '{}' ({} bytes)",
                                        path_.string(), name, name.size()));
    }
    prefix = name.substr(0, slash);
    rest = name.substr(slash + 1);
  }
  if (name.empty() || bytes.size() >= (uint64_t{1} << 33)) {
    throw InvalidArgument(fmt::format("{}: a ustar member needs a name and under 8 GiB, found '{}' of {} bytes",
                                      path_.string(), name, bytes.size()));
  }
  Block b{};
  std::memcpy(b.data(), rest.data(), rest.size());
  std::snprintf(reinterpret_cast<char*>(b.data() + 100), 8, "%07o", 0644);
  std::snprintf(reinterpret_cast<char*>(b.data() + 108), 8, "%07o", 0);
  std::snprintf(reinterpret_cast<char*>(b.data() + 116), 8, "%07o", 0);
  std::snprintf(reinterpret_cast<char*>(b.data() + 124), 12, "%011llo", static_cast<unsigned long long>(bytes.size()));
  std::snprintf(reinterpret_cast<char*>(b.data() + 136), 12, "%011o", 0);
  b[156] = '0';
  std::memcpy(b.data() + 257, "ustar", 6);  // "ustar\0" then version "00"
  b[263] = '0';
  b[264] = '0';
  std::memcpy(b.data() + 345, prefix.data(), prefix.size());
  std::memset(b.data() + 148, ' ', 8);
  uint64_t sum = 0;
  for (uint8_t x : b) sum += x;
  std::snprintf(reinterpret_cast<char*>(b.data() + 148), 8, "%06llo", static_cast<unsigned long long>(sum));
  b[155] = ' ';
  write(b.data(), kBlock);
  write(bytes.data(), bytes.size());
  static const Block zeros{};
  write(zeros.data(), padded(bytes.size()) - bytes.size());
}

void TarWriter::finish() {
  static const Block zeros{};
  write(zeros.data(), kBlock);
  write(zeros.data(), kBlock);
  if (::close(fd_) != 0) {
    fd_ = -1;
    throw IoError(fmt::format("{}: closing: {}", path_.string(), system_error()));
  }
  fd_ = -1;
}

}  // namespace mtrain::data
