// POSIX tar archives, the container of WebDataset shards: listing a tar's regular files
// from their headers alone (ustar, GNU tar's long names, pax records' paths), reading one
// member's bytes by offset, and writing ustar archives that GNU tar and Python's tarfile
// read. Every error is an IoError naming the archive, and the member or byte offset.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mtrain::data {

struct TarMember {
  std::string name;     // the full path inside the archive
  uint64_t offset = 0;  // of its first data byte
  uint64_t size = 0;
};

struct TarListing {
  std::vector<TarMember> members;  // regular files, in archive order
  // Empty for a whole archive; else why the listing stopped early (an archive cut short, a
  // header that is not a tar header) with the byte offset: the members before it are whole.
  std::string damage;
};

// Lists the regular files of the tar at `path`, reading only headers (Note [Reading tar
// headers] in tar.cpp). Directories, links and other entries are passed over. IoError
// when the file cannot be read or is not a tar at all (its first header is damaged).
TarListing list_tar(const std::filesystem::path& path);

// An open archive (or any file) to read members from; safe to share between threads.
class ReadOnlyFile {
 public:
  explicit ReadOnlyFile(const std::filesystem::path& path);  // IoError when it cannot be opened
  ~ReadOnlyFile();
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;

  uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }
  // Tells the kernel that reads will jump (no read-ahead beyond what is asked).
  void expect_jumps() const;
  // `size` bytes from `offset`; IoError (naming `what`) when the file ends before them.
  std::vector<uint8_t> read(uint64_t offset, uint64_t size, const std::string& what) const;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Writes a ustar archive member by member; the file is complete after finish(). Names up
// to 255 bytes (ustar's prefix and name fields), sizes below 8 GiB.
class TarWriter {
 public:
  explicit TarWriter(const std::filesystem::path& path);  // IoError when it cannot be created
  ~TarWriter();
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;

  // InvalidArgument for a name ustar cannot hold; IoError when writing fails.
  void add(const std::string& name, const std::vector<uint8_t>& bytes);
  // The two zero blocks that end an archive, then close; IoError when that fails.
  void finish();
  uint64_t bytes_written() const { return written_; }

 private:
  void write(const void* data, size_t size);
  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

}  // namespace mtrain::data
