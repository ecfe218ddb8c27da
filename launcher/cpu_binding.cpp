#include "launcher/cpu_binding.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <tuple>

#include <fmt/format.h>

#include "core/error.h"

namespace mtrain::launch {
namespace {

// One integer from a sysfs topology file, or `fallback` where the file is missing or
// holds something else (containers may hide /sys).
int read_topology(int cpu, const char* name, int fallback) {
  std::ifstream in(fmt::format("/sys/devices/system/cpu/cpu{}/topology/{}", cpu, name));
  int value = 0;
  if (in >> value && value >= 0) return value;
  return fallback;
}

}  // namespace

std::vector<CpuInfo> usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) {
    throw IoError(fmt::format("--cpu_bind: cannot read the launcher's CPU affinity: {}",
                              std::strerror(errno)));
  }
  std::vector<CpuInfo> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    cpus.push_back({cpu, read_topology(cpu, "physical_package_id", 0),
                    read_topology(cpu, "core_id", cpu)});
  }
  return cpus;
}

// Note [Binding workers to CPUs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Unbound, the kernel moves a worker's threads between cores as load shifts, and two
// workers' threads meet on one core now and then. Data-parallel ranks wait for each other
// at every collective (twice per BatchNorm layer under SyncBatchNorm), so one rank's delay
// becomes everyone's; mpirun binds to cores for this reason (`--bind-to core`), torchrun
// does not. The launcher's own affinity mask already reflects taskset, cgroup cpusets and
// SLURM's binding. Ordering by (package, core, CPU number) keeps a core's hyperthreads and
// a socket's cores together, and slices are of whole cores unless workers outnumber cores.
// What the division leaves over goes to nobody: an uneven share would make one rank the
// slowest at every meeting. A worker's threads, helpers included, inherit its slice, so
// OMP_NUM_THREADS defaults to the slice's size rather than 1.

std::vector<std::vector<int>> split_cpus(std::vector<CpuInfo> cpus, int workers) {
  if (workers < 1 || static_cast<int>(cpus.size()) < workers) {
    std::vector<int> numbers;
    for (const auto& c : cpus) numbers.push_back(c.cpu);
    throw InvalidArgument(fmt::format(
        "--cpu_bind cores: expected at least one CPU per local worker, found {} workers and "
        "{} usable CPU(s) ({}); use fewer workers or --cpu_bind none",
        workers, cpus.size(), numbers.empty() ? "none" : format_cpu_list(numbers)));
  }
  std::sort(cpus.begin(), cpus.end(), [](const CpuInfo& a, const CpuInfo& b) {
    return std::tie(a.package, a.core, a.cpu) < std::tie(b.package, b.core, b.cpu);
  });
  // Whole cores while there are enough of them, so that no core's hyperthreads go to two
  // workers; single CPUs only when there are more workers than cores.
  std::vector<std::vector<int>> cores;
  for (size_t i = 0; i < cpus.size(); ++i) {
    const bool same_core = i > 0 && cpus[i].package == cpus[i - 1].package && cpus[i].core == cpus[i - 1].core;
    if (!same_core) cores.emplace_back();
    cores.back().push_back(cpus[i].cpu);
  }
  if (static_cast<int>(cores.size()) < workers) {
    cores.clear();
    for (const auto& c : cpus) cores.push_back({c.cpu});
  }
  const size_t share = cores.size() / static_cast<size_t>(workers);
  std::vector<std::vector<int>> out(static_cast<size_t>(workers));
  for (size_t w = 0; w < out.size(); ++w) {
    for (size_t k = 0; k < share; ++k) {
      const auto& core = cores[w * share + k];
      out[w].insert(out[w].end(), core.begin(), core.end());
    }
    std::sort(out[w].begin(), out[w].end());
  }
  return out;
}

std::string format_cpu_list(std::vector<int> cpus) {
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace mtrain::launch
