#include "collectives/nccl/device_identity.h"

#include <fmt/format.h>
#include <unistd.h>

#include <climits>

#include "core/error.h"

namespace mtrain {

namespace {
// Fields never contain a newline (host names and PCI ids cannot), so it separates them.
std::string encode(const DeviceIdentity& d) { return d.host + "\n" + d.pci_bus + "\n" + d.label; }

DeviceIdentity decode(const std::string& text, int rank) {
  const size_t a = text.find('\n');
  const size_t b = a == std::string::npos ? std::string::npos : text.find('\n', a + 1);
  if (b == std::string::npos) {
    throw CommError(fmt::format("rank {} published a malformed device identity '{}' "
                                "(expected host, PCI bus id and label on three lines)",
                                rank, text));
  }
  return DeviceIdentity{text.substr(0, a), text.substr(a + 1, b - a - 1), text.substr(b + 1)};
}
}  // namespace

std::optional<std::pair<int, int>> find_shared_device(const std::vector<DeviceIdentity>& ranks) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    for (size_t j = i + 1; j < ranks.size(); ++j) {
      if (ranks[i].host == ranks[j].host && ranks[i].pci_bus == ranks[j].pci_bus) {
        return std::make_pair(static_cast<int>(i), static_cast<int>(j));
      }
    }
  }
  return std::nullopt;
}

void check_one_device_per_rank(Store& store, const std::string& prefix, const std::string& group,
                               int rank, int size, const DeviceIdentity& self, Millis timeout) {
  auto key = [&](int r) { return fmt::format("{}/device/{}", prefix, r); };
  store.set(key(rank), encode(self));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  store.wait(keys, timeout);
  std::vector<DeviceIdentity> all;
  for (int r = 0; r < size; ++r) all.push_back(decode(store.get_string(key(r)), r));
  const auto shared = find_shared_device(all);
  if (!shared) return;
  const auto [a, b] = *shared;
  throw InvalidArgument(fmt::format(
      "nccl group '{}': ranks {} and {} both use the GPU at PCI bus {} on host {} (rank {} calls "
      "it {}, rank {} calls it {}); NCCL needs a GPU of its own for every rank: start at most as "
      "many ranks per host as it has GPUs (check CUDA_VISIBLE_DEVICES and --nproc_per_node), or "
      "use --backend gloo",
      group, a, b, all[a].pci_bus, all[a].host, a, all[a].label, b, all[b].label));
}

std::string local_host_name() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

}  // namespace mtrain
