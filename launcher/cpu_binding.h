// Binding each local worker to its own share of the node's CPUs (--cpu_bind cores).
//
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

// Slices of `cpus` for `workers` local workers (Note [Binding workers to CPUs]), each
// sorted by CPU number. Throws InvalidArgument when there are fewer CPUs than workers.
std::vector<std::vector<int>> split_cpus(std::vector<CpuInfo> cpus, int workers);

// "0-3,8,10-11" (the kernel's cpulist format); the list need not be sorted.
std::string format_cpu_list(std::vector<int> cpus);

}  // namespace mtrain::launch
