// printable_text: outside bytes in one-line messages.
#include <catch2/catch.hpp>

#include <string>

#include "core/text.h"

using mtrain::printable_text;

TEST_CASE("printable ASCII and well-formed UTF-8 pass; everything else is escaped") {
  CHECK(printable_text("tensor 'fc.weight'") == "tensor 'fc.weight'");
  CHECK(printable_text("poids \xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80") ==
        "poids \xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  CHECK(printable_text(std::string("a\0b\nc\x7f", 6)) == "a\\x00b\\x0ac\\x7f");
  CHECK(printable_text("back\\slash") == "back\\\\slash");
  // Well-formed, but line breaks all the same: NEL (U+0085), U+2028, U+2029.
  CHECK(printable_text("a\xc2\x85" "b\xe2\x80\xa8" "c\xe2\x80\xa9") == "a\\xc2\\x85b\\xe2\\x80\\xa8c\\xe2\\x80\\xa9");
  CHECK(printable_text("\xc2\xa0") == "\xc2\xa0");  // NO-BREAK SPACE is text
  // A lone continuation byte, a cut-off sequence, an overlong '/', a surrogate, above U+10FFFF.
  CHECK(printable_text("\x80") == "\\x80");
  CHECK(printable_text("\xe2\x82") == "\\xe2\\x82");
  CHECK(printable_text("\xc0\xaf") == "\\xc0\\xaf");
  CHECK(printable_text("\xed\xa0\x80") == "\\xed\\xa0\\x80");
  CHECK(printable_text("\xf4\x90\x80\x80") == "\\xf4\\x90\\x80\\x80");
}

TEST_CASE("long text is cut at a character boundary and says how long it was") {
  CHECK(printable_text(std::string(10, 'x'), 4) == "xxxx... (10 bytes in all)");
  CHECK(printable_text("ab\xc3\xa9", 3) == "ab... (4 bytes in all)");
  CHECK(printable_text("abcd", 4) == "abcd");
  CHECK(printable_text(std::string(1000, 'y')).size() == 400 + std::string("... (1000 bytes in all)").size());
}
