// Bytes from outside (file contents, parser messages quoting them) made fit for a
// one-line error message.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace mtrain {

// `text` with every byte that is neither printable ASCII nor part of a well-formed
// UTF-8 character written as \xNN (control characters and newlines included, C1
// controls and U+2028/U+2029 too, and the backslash as \\, so the result is one line
// and reads back unambiguously). Past
// `limit` bytes of `text` it is cut at a character boundary and ends with
// "... (N bytes in all)".
std::string printable_text(std::string_view text, size_t limit = 400);

}  // namespace mtrain
