// Whole-file writes that a concurrent reader never sees half done, and the room a
// directory has for them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace mtrain {

// Writes `contents` to a temporary file beside `path` and renames it over `path`, so a reader
// sees the old file or the new one, never a part. Throws IoError naming the file and the
// system's reason; no temporary file is left behind on a failed rename.
void replace_file(const std::string& path, std::string_view contents);

// The bytes an unprivileged writer may still put on the filesystem holding `dir`
// (statvfs's f_bavail); throws IoError naming the directory when it cannot be asked.
uint64_t free_bytes(const std::string& dir);

}  // namespace mtrain
