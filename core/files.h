// Whole-file writes that a concurrent reader never sees half done.
#pragma once

#include <string>
#include <string_view>

namespace mtrain {

// Writes `contents` to a temporary file beside `path` and renames it over `path`, so a reader
// sees the old file or the new one, never a part. Throws IoError naming the file and the
// system's reason; no temporary file is left behind on a failed rename.
void replace_file(const std::string& path, std::string_view contents);

}  // namespace mtrain
