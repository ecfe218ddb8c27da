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
// workers' threads meet on one core now and then. For data-parallel training that costs
// more than the lost cycles: the ranks meet at every collective (twice per BatchNorm layer
// under SyncBatchNorm), and whichever rank was delayed makes the others wait. mpirun binds
// its processes to cores for the same reason (`--bind-to core`); torchrun does not.
//
// With --cpu_bind cores the launcher takes the CPUs it may itself run on (its affinity
// mask, which already reflects taskset, cgroup cpusets and SLURM's binding), orders them
// by (package, core, CPU number) so that hyperthreads of one core and cores of one socket
// are neighbours, and gives local rank i the i-th of nproc_per_node equal consecutive
// slices of whole cores (all of a core's hyperthreads together); only when there are
// more workers than cores are single CPUs shared out instead. What the division leaves
// over is given to nobody (an uneven share would make one rank the slowest at every
// meeting); fewer CPUs than workers is an error. Every thread
// of a worker, helper threads included, inherits its slice. When the user has not set
// OMP_NUM_THREADS, workers get the size of their slice instead of 1.

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
