// The environment each worker starts with: the launcher's own, plus torchrun's names
// and mtrain's (docs/launcher.md, "Environment").
#pragma once

#include <string>
#include <vector>

namespace mtrain::launch {

struct WorkerEnvInputs {
  int local_rank = 0;
  int global_rank = 0;
  int local_world_size = 1;
  int world_size = 1;
  int group_rank = 0;        // node rank
  int group_world_size = 1;  // number of nodes
  std::string role = "default";
  std::string master_addr;  // the workers' own rendezvous (a free port), torchrun's MASTER_ADDR
  int master_port = 0;
  std::string store_addr;   // the launcher's store, for mtrain's workers
  int store_port = 0;
  int restart_count = 0;
  int max_restarts = 0;
  std::string run_id;
  std::string error_file;
  std::string store_token;
  std::string store_prefix;
  int omp_num_threads = 0;  // OMP_NUM_THREADS for the worker; 0 = inherit the launcher's
};

// `base` is "KEY=VALUE" entries (the launcher's environ); variables the launcher sets
// replace any inherited value, everything else passes through.
std::vector<std::string> build_worker_environment(const std::vector<std::string>& base,
                                                  const WorkerEnvInputs& in);

// The launcher's environment as "KEY=VALUE" entries.
std::vector<std::string> current_environment();

}  // namespace mtrain::launch
