// SLURM's compressed host lists ("node[01-04,07],gpu-a[1-2]") expanded to host names,
// as `scontrol show hostnames` does. Used to find the master (the first host) when
// SLURM, not a launcher, started the ranks.
//
// Note [Hostlist syntax]
// ~~~~~~~~~~~~~~~~~~~~~~
// A list is comma-separated host expressions; commas inside brackets separate range
// items instead. An expression is literal text with any number of bracket groups, each
// a comma-separated list of numbers or lo-hi ranges; several groups expand as a
// cartesian product, leftmost slowest ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). A range
// keeps the width of its lower bound as written, so "[08-10]" gives 08 09 10 and
// "[8-10]" gives 8 9 10. Duplicates are kept, order is as written. Anything else (an
// empty expression or group, unbalanced or nested brackets, a reversed range, a
// non-digit in a group, more than kMaxHosts names or kMaxHostBytes of them) is
// InvalidArgument quoting the list and the offending part.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace mtrain {

inline constexpr size_t kMaxHosts = 1 << 20;
inline constexpr size_t kMaxHostBytes = size_t{64} << 20;

std::vector<std::string> expand_hostlist(std::string_view list);

}  // namespace mtrain
