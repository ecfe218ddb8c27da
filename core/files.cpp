#include "core/files.h"

#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/error.h"

namespace mtrain {

void replace_file(const std::string& path, std::string_view contents) {
  const std::string temporary = fmt::format("{}.tmp.{}", path, ::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) throw IoError(fmt::format("cannot write {}: {}", temporary, std::strerror(errno)));
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.close();
    if (!out) {
      std::remove(temporary.c_str());
      throw IoError(fmt::format("writing {} failed (disk full?)", temporary));
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(temporary.c_str());
    throw IoError(fmt::format("cannot rename {} to {}: {}", temporary, path, std::strerror(err)));
  }
}

uint64_t free_bytes(const std::string& dir) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) {
    throw IoError(fmt::format("cannot tell the free space of {}: {}", dir, std::strerror(errno)));
  }
  return static_cast<uint64_t>(fs.f_bavail) * static_cast<uint64_t>(fs.f_frsize);
}

}  // namespace mtrain
