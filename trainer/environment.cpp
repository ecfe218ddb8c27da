#include "trainer/environment.h"

#include <sched.h>

#include <thread>

#include "core/env.h"
#include "core/error.h"

namespace mtrain {

namespace {

// The first of `names` that is set, parsed as an integer >= 1.
std::optional<std::pair<int, std::string>> first_positive(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (auto v = env::get_int(name, 1, 1 << 20)) return std::pair{static_cast<int>(*v), std::string(name)};
  }
  return std::nullopt;
}

}  // namespace

WorkerEnvironment discover_environment() {
  WorkerEnvironment w;
  if (auto local = first_positive({"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"})) {
    w.local_world_size = local->first;
    w.local_world_size_source = local->second;
  }
  if (auto world = first_positive({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"})) {
    w.requested_world_size = world->first;
    w.requested_world_size_source = world->second;
  }
  return w;
}

int usable_cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

ThreadChoice resolve_num_threads(std::optional<int> flag, const WorkerEnvironment& env) {
  if (flag) {
    if (*flag < 1) throw InvalidArgument(fmt::format("--threads: expected an integer >= 1, found {}", *flag));
    return {*flag, "--threads"};
  }
  if (auto omp = env::get("OMP_NUM_THREADS")) {
    const auto n = env::parse_int(*omp, "environment variable OMP_NUM_THREADS", 1, 4096);
    return {static_cast<int>(n), fmt::format("OMP_NUM_THREADS={}", n)};
  }
  if (env.local_world_size > 1) {
    return {1, fmt::format("1 per rank: {}={} ranks share this node", env.local_world_size_source,
                           env.local_world_size)};
  }
  const int cpus = usable_cpu_count();
  return {cpus, fmt::format("all {} usable cores", cpus)};
}

}  // namespace mtrain
