#include "core/files.h"

#include <fmt/format.h>
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

}  // namespace mtrain
