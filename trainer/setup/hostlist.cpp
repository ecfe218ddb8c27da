#include "trainer/setup/hostlist.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "core/error.h"

namespace mtrain {
namespace {

constexpr size_t kMaxDigits = 9;  // keeps every bound within int64 arithmetic

// Splits at commas outside brackets; brackets are checked for balance on the way.
std::vector<std::string_view> split_top_level(std::string_view list) {
  std::vector<std::string_view> parts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const char c = list[i];
    if (c == '[') {
      if (depth > 0) {
        throw InvalidArgument(fmt::format("host list '{}': nested '[' at offset {}", list, i));
      }
      ++depth;
    } else if (c == ']') {
      if (depth == 0) {
        throw InvalidArgument(fmt::format("host list '{}': ']' at offset {} closes nothing", list, i));
      }
      --depth;
    } else if (c == ',' && depth == 0) {
      parts.push_back(list.substr(start, i - start));
      start = i + 1;
    }
  }
  if (depth != 0) throw InvalidArgument(fmt::format("host list '{}': a '[' is never closed", list));
  parts.push_back(list.substr(start));
  return parts;
}

bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

int64_t to_number(std::string_view digits) {
  int64_t v = 0;
  for (char c : digits) v = v * 10 + (c - '0');
  return v;
}

// "01-03,7" -> {"01", "02", "03", "7"}.
std::vector<std::string> expand_group(std::string_view list, std::string_view group) {
  const auto bad = [&](std::string_view item, std::string_view why) {
    return InvalidArgument(
        fmt::format("host list '{}': bad range '{}' in '[{}]': {}", list, item, group, why));
  };
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= group.size()) {
    size_t end = group.find(',', start);
    if (end == std::string_view::npos) end = group.size();
    const std::string_view item = group.substr(start, end - start);
    const size_t dash = item.find('-');
    const std::string_view lo = item.substr(0, dash);
    const std::string_view hi = dash == std::string_view::npos ? lo : item.substr(dash + 1);
    if (item.empty()) throw bad(item, "expected a number or lo-hi, found nothing");
    if (!all_digits(lo) || !all_digits(hi)) throw bad(item, "expected digits (a number or lo-hi)");
    if (lo.size() > kMaxDigits || hi.size() > kMaxDigits) throw bad(item, "numbers have at most 9 digits");
    const int64_t a = to_number(lo);
    const int64_t b = to_number(hi);
    if (b < a) throw bad(item, "the upper bound is below the lower bound");
    if (out.size() + static_cast<size_t>(b - a + 1) > kMaxHosts) {
      throw bad(item, fmt::format("more than {} hosts", kMaxHosts));
    }
    for (int64_t v = a; v <= b; ++v) out.push_back(fmt::format("{:0{}d}", v, lo.size()));
    start = end + 1;
  }
  return out;
}

void expand_expression(std::string_view list, std::string_view expr, std::vector<std::string>& out) {
  if (expr.empty()) throw InvalidArgument(fmt::format("host list '{}': empty host name between commas", list));
  std::vector<std::string> names{""};
  size_t i = 0;
  while (i < expr.size()) {
    const size_t open = expr.find('[', i);
    const std::string_view text = expr.substr(i, open == std::string_view::npos ? std::string_view::npos : open - i);
    for (auto& n : names) n += text;
    if (open == std::string_view::npos) break;
    const size_t close = expr.find(']', open);  // balanced: split_top_level checked
    const std::vector<std::string> items = expand_group(list, expr.substr(open + 1, close - open - 1));
    if (names.size() * items.size() > kMaxHosts) {
      throw InvalidArgument(fmt::format("host list '{}': '{}' names more than {} hosts", list, expr, kMaxHosts));
    }
    // Long names times many hosts: bound the bytes too (a 200-character prefix on a
    // million hosts would take most of a GiB), counting each name at the longest.
    size_t longest_item = 0;
    for (const auto& item : items) longest_item = std::max(longest_item, item.size());
    const size_t name_bytes = names.front().size() + longest_item + (expr.size() - close);
    if (names.size() * items.size() * name_bytes > kMaxHostBytes) {
      throw InvalidArgument(fmt::format("host list '{}': '{}' expands to more than {} MiB of host names", list,
                                        expr, kMaxHostBytes >> 20));
    }
    std::vector<std::string> product;
    product.reserve(names.size() * items.size());
    for (const auto& n : names) {
      for (const auto& item : items) product.push_back(n + item);
    }
    names = std::move(product);
    i = close + 1;
  }
  if (out.size() + names.size() > kMaxHosts) {
    throw InvalidArgument(fmt::format("host list '{}' names more than {} hosts", list, kMaxHosts));
  }
  out.insert(out.end(), names.begin(), names.end());
}

}  // namespace

// Note [Hostlist syntax]
// ~~~~~~~~~~~~~~~~~~~~~~
// A list is comma-separated host expressions; commas inside brackets separate range items
// instead. An expression is literal text with any number of bracket groups, each a
// comma-separated list of numbers or lo-hi ranges; several groups expand as a cartesian product,
// leftmost slowest ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). A range keeps the width of its lower
// bound as written, so "[08-10]" gives 08 09 10 and "[8-10]" gives 8 9 10. Duplicates are kept,
// order is as written. Anything else (an empty expression or group, unbalanced or nested
// brackets, a reversed range, a non-digit in a group, more than kMaxHosts names or kMaxHostBytes
// of them) is InvalidArgument quoting the list and the offending part.
std::vector<std::string> expand_hostlist(std::string_view list) {
  if (list.empty()) throw InvalidArgument("host list is empty; expected e.g. 'node[01-04,07],gpu1'");
  std::vector<std::string> hosts;
  for (std::string_view expr : split_top_level(list)) expand_expression(list, expr, hosts);
  return hosts;
}

}  // namespace mtrain
