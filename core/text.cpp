#include "core/text.h"

#include <fmt/format.h>

#include <algorithm>

namespace mtrain {

namespace {

// Length of the well-formed UTF-8 character starting at text[i] (2 to 4 bytes: no
// overlong forms, no surrogates, nothing above U+10FFFF), or 0.
size_t utf8_length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b0 = byte(i);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;  // the range of the second byte
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    n = 2;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    n = 3;
    if (b0 == 0xe0) lo = 0xa0;
    if (b0 == 0xed) hi = 0x9f;
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    n = 4;
    if (b0 == 0xf0) lo = 0x90;
    if (b0 == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (i + n > text.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xbf) return 0;
  }
  return n;
}

// C1 controls (U+0080-U+009F, such as NEL) and the line and paragraph separators
// (U+2028, U+2029): well-formed, but they break a line as a newline does.
bool is_control_or_separator(std::string_view c) {
  return (c.size() == 2 && static_cast<unsigned char>(c[0]) == 0xc2 && static_cast<unsigned char>(c[1]) < 0xa0) ||
         c == "\xe2\x80\xa8" || c == "\xe2\x80\xa9";
}

}  // namespace

std::string printable_text(std::string_view text, size_t limit) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n = 1;
    if (c >= 0x80) n = utf8_length(text, i);
    if (i + (n == 0 ? 1 : n) > limit) break;
    if (c == '\\') {
      out += "\\\\";
    } else if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else if (n >= 2 && !is_control_or_separator(text.substr(i, n))) {
      out.append(text.substr(i, n));
    } else {
      n = std::max<size_t>(n, 1);  // a stray byte, or every byte of a line-breaking character
      for (size_t k = 0; k < n; ++k) out += fmt::format("\\x{:02x}", static_cast<unsigned char>(text[i + k]));
    }
    i += n;
  }
  if (i < text.size()) out += fmt::format("... ({} bytes in all)", text.size());
  return out;
}

}  // namespace mtrain
