// Binding each local worker to its own share of the node's CPUs (--cpu_bind cores):
// equal slices of the CPUs this launcher may run on, each worker's threads and children
// confined to its slice (Note [Binding workers to CPUs] in cpu_binding.cpp).
#pragma once

#include <string>
#include <vector>

namespace mtrain::launch {

enum class CpuBind { kNone, kCores };

struct CpuInfo {
  int cpu = 0;
  int package = 0;  // physical_package_id in sysfs; 0 where unknown
  int core = 0;     // core_id in sysfs; the CPU number where unknown
};

// The CPUs this process may run on (sched_getaffinity), with their topology from
// /sys/devices/system/cpu/cpuN/topology.
std::vector<CpuInfo> usable_cpus();

// Slice i of `cpus` for local rank i of `workers`, sorted by CPU number: the CPUs in
// (package, core, CPU number) order, cut into equal consecutive shares of whole cores
// (of single CPUs when workers outnumber cores); what is left over goes to nobody.
// Throws InvalidArgument when there are fewer CPUs than workers.
std::vector<std::vector<int>> split_cpus(std::vector<CpuInfo> cpus, int workers);

// "0-3,8,10-11" (the kernel's cpulist format); the list need not be sorted.
std::string format_cpu_list(std::vector<int> cpus);

}  // namespace mtrain::launch
