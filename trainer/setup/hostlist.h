// SLURM's compressed host lists ("node[01-04,07],gpu-a[1-2]") expanded to host names, as
// `scontrol show hostnames` does, in the order written, duplicates kept. Used to find the master
// (the first host) when SLURM, not a launcher, started the ranks. The syntax: Note [Hostlist
// syntax] in hostlist.cpp.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace mtrain {

inline constexpr size_t kMaxHosts = 1 << 20;
inline constexpr size_t kMaxHostBytes = size_t{64} << 20;

// Throws InvalidArgument quoting the list and the offending part for anything the syntax does
// not allow, and for more than kMaxHosts names or kMaxHostBytes of them.
std::vector<std::string> expand_hostlist(std::string_view list);

}  // namespace mtrain
